"""Classify images with a trained checkpoint: ``python scripts/predict.py ckpt_path=<ckpt> inputs=<images>``.

``inputs`` is an image file, a folder of images or a quoted glob; the top ``top_k`` classes of each image are
printed with their probabilities and written to ``<output_dir>/predictions.csv``.
"""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.predict:predict", "predict", Path(__file__).parents[1] / "configs")
