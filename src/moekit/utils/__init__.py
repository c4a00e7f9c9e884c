"""Small utilities shared by scripts and training code."""
