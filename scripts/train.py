"""Train a model: ``python scripts/train.py experiment=soft_moe_vit``.

Fits, then tests the best checkpoint, and prints where logs and checkpoints went. Every config
value can be overridden from the command line (``trainer.max_epochs=3``, ``moe.num_experts=32``,
``seed=1``, ``paths.output_dir=runs/a``, ``ckpt_path=<last.ckpt>`` to resume); ``-m`` sweeps.
"""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.train:run", "train", Path(__file__).parents[1] / "configs")
