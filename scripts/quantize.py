"""Quantize a checkpoint's expert banks:
``python scripts/quantize.py ckpt_path=<ckpt> bits=8|4|2|ternary method=rtn|gptq``."""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.quantize:quantize", "quantize", Path(__file__).parents[1] / "configs")
