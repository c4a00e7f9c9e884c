"""moekit: Mixture-of-Experts layers, timm models and Lightning + Hydra training."""

__version__ = "0.1.0"
