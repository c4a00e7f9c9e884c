"""Few-shot linear probe of a checkpoint's frozen network (the Soft MoE paper's 10-shot protocol):
``python scripts/linear_probe.py ckpt_path=<ckpt> [shots=10] [data=<dataset>]``."""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.probe:linear_probe", "linear_probe", Path(__file__).parents[1] / "configs")
