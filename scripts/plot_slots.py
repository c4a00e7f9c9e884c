"""Soft MoE slot pictures of a checkpoint: ``python scripts/plot_slots.py ckpt_path=<ckpt> out=slots.png``
(``num_images=4``, ``slots=4`` or ``slots=[0,5,17]``, ``layer=-1``; the images come from the checkpoint's
own dataset unless ``data=`` is given)."""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.plot_slots:plot_slots", "plot_slots", Path(__file__).parents[1] / "configs")
