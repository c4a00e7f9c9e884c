"""Export a checkpoint's network as safetensors that timm loads:
``python scripts/export.py ckpt_path=<ckpt> [output_path=model.safetensors]``."""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.export:export", "export", Path(__file__).parents[1] / "configs")
