"""``scripts/predict.py``: the top-k classes of images from an image-classifier checkpoint, as a table and a CSV."""

from __future__ import annotations

import csv
import glob
import io
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from moekit.checkpoint import load_task
from moekit.data.datamodule import eval_images
from moekit.data.imagefolder import UnreadableImageError, read_rgb_image
from moekit.errors import check_writable_dir
from moekit.tasks import ImageClassifier
from moekit.utils.atomic import write_text_atomic

from .common import inference_device

__all__ = ["IMAGE_SUFFIXES", "image_paths", "predict"]

log = logging.getLogger("moekit")

# torchvision's ImageFolder suffixes (what data=imagefolder trains on), and .gif
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
PREDICTIONS_FILE = "predictions.csv"


def image_paths(inputs: str) -> list[Path]:
    """The images ``inputs`` names: one file, or the image files (by suffix, :data:`IMAGE_SUFFIXES`) under a folder
    (recursively) or among a glob pattern's matches; sorted."""
    path = Path(inputs).expanduser()
    if path.is_file():
        return [path]
    found = path.rglob("*") if path.is_dir() else map(Path, glob.glob(str(path), recursive=True))
    files = sorted(p for p in found if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(
            f"inputs={inputs!r}: no image there; give an image file, a folder holding images "
            f"({', '.join(IMAGE_SUFFIXES)}) or a quoted glob such as 'inputs=\"photos/*.png\"'"
        )
    return files


def predict(cfg: DictConfig) -> list[dict]:
    """Classify the images of ``cfg.inputs`` with the checkpoint's network, prepared like its dataset's evaluation
    split; log a table of each image's ``top_k`` classes and write them to ``<output_dir>/predictions.csv``.
    A file that is not an image PIL can decode (truncated, or a macOS ``._*`` resource fork beside the photos) is
    skipped with a warning naming it; none readable is an error. Returns the rows (``file, rank, label, class,
    probability``)."""
    module = load_task(cfg.ckpt_path)
    if not isinstance(module, ImageClassifier):
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} holds a {type(module).__name__}, not an image classifier; for a language "
            "model use scripts/sample.py"
        )
    num_classes = module.net.num_classes
    if isinstance(cfg.top_k, bool) or not (isinstance(cfg.top_k, int) and 1 <= cfg.top_k):  # top_k=true: not 1
        raise ValueError(f"top_k={cfg.top_k!r}; give a whole number from 1 to the {num_classes} classes")
    if isinstance(cfg.batch_size, bool) or not (isinstance(cfg.batch_size, int) and cfg.batch_size >= 1):
        raise ValueError(f"batch_size={cfg.batch_size!r}; give a whole number >= 1")
    output_dir = check_writable_dir(cfg.paths.output_dir, "paths.output_dir")
    data = (module.hparams.get("run_config") or {}).get("data") or {}
    dataset, img_size = data.get("dataset", "fashion_mnist"), data.get("img_size")
    names = module.class_names or [f"class {i}" for i in range(num_classes)]
    paths = image_paths(str(cfg.inputs))
    k = min(cfg.top_k, num_classes)
    device = inference_device(cfg.device)
    module.to(device)
    rows, unreadable = [], []
    for start in range(0, len(paths), cfg.batch_size):
        batch, pictures = [], []
        for path in paths[start : start + cfg.batch_size]:
            try:
                pictures.append(read_rgb_image(str(path)))
                batch.append(path)
            except UnreadableImageError as err:
                log.warning("%s; skipped it", err)
                unreadable.append(path)
        if not batch:
            continue
        images = eval_images(dataset, pictures, img_size).to(device)
        with torch.inference_mode():
            probabilities = module(images).float().softmax(dim=-1)  # [B, num_classes]
        top = probabilities.topk(k, dim=-1)
        for path, values, labels in zip(batch, top.values.tolist(), top.indices.tolist(), strict=True):
            for rank, (p, label) in enumerate(zip(values, labels, strict=True), start=1):
                rows.append({"file": str(path), "rank": rank, "label": label, "class": names[label], "probability": p})
    if not rows:
        raise ValueError(
            f"inputs={cfg.inputs!r}: none of its {len(paths)} image file(s) could be read (the first: "
            f"{unreadable[0]}); give images PIL can open"
        )
    if unreadable:
        log.warning("skipped %d of %d files that are not readable images", len(unreadable), len(paths))
    write_text_atomic(output_dir / PREDICTIONS_FILE, _csv(rows))
    log.info("%s\n  predictions: %s", _table(rows, k), output_dir / PREDICTIONS_FILE)
    return rows


def _csv(rows: list[dict]) -> str:
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=["file", "rank", "label", "class", "probability"])
    writer.writeheader()
    writer.writerows({**row, "probability": f"{row['probability']:.6f}"} for row in rows)
    return buffer.getvalue()


def _table(rows: list[dict], k: int) -> str:
    """One line per image: its file, then its ``k`` classes with their probabilities."""
    lines = []
    for start in range(0, len(rows), k):
        ranked = rows[start : start + k]
        classes = "  ".join(f"{row['class']} {row['probability']:.1%}" for row in ranked)
        lines.append(f"  {ranked[0]['file']}:  {classes}")
    return f"top-{k} classes of {len(rows) // k} images:\n" + "\n".join(lines)
