"""Test a checkpoint: ``python scripts/eval.py ckpt_path=<run>/checkpoints/last.ckpt`` (the network and,
unless ``data=`` is given, the dataset come from the checkpoint)."""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.evaluate:evaluate", "eval", Path(__file__).parents[1] / "configs")
