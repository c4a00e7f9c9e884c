"""``scripts/plot_slots.py``: Soft MoE slot pictures of a checkpoint (the Soft MoE paper's Figure 10)."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, ListConfig
from torchvision.utils import save_image

from moekit.callbacks.slots import pick_images, slot_picture_grid, soft_moe_layers
from moekit.checkpoint import load_task
from moekit.moe import moe_layers
from moekit.tasks import ImageClassifier

from .common import datamodule_for, inference_device

log = logging.getLogger("moekit")

__all__ = ["plot_slots"]


def plot_slots(cfg: DictConfig) -> Path:
    """Draw the dispatch weights of a few slots of a Soft MoE checkpoint over ``num_images`` images of
    the checkpoint's dataset (``split``: val or test) and save them as one PNG at ``out`` (see
    :mod:`moekit.callbacks.slots`). Returns the path."""
    module = load_task(cfg.ckpt_path)
    if not isinstance(module, ImageClassifier) or not soft_moe_layers(module.net):
        kinds = sorted({type(layer).__name__ for _, layer in moe_layers(module.net)})
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} holds a {type(module).__name__} with no Soft MoE layer "
            f"(MoE modules: {kinds or 'none, a dense model'}); slot pictures need a Soft MoE ViT checkpoint, "
            "e.g. one trained with experiment=soft_moe_vit"
        )
    if cfg.split not in ("val", "test"):
        raise ValueError(f"split={cfg.split!r}; allowed: 'val', 'test'")
    device = inference_device(cfg.device)
    datamodule = datamodule_for(cfg, module, same_labels=False)  # pictures of images, whatever their labels
    datamodule.setup("validate")
    dataset = datamodule.val_set if cfg.split == "val" and len(datamodule.val_set) else datamodule.test_set
    images = pick_images(dataset, cfg.num_images)
    slots = list(cfg.slots) if isinstance(cfg.slots, ListConfig) else cfg.slots
    grid = slot_picture_grid(module.net.to(device), images.to(device), slots, cfg.layer, cfg.upscale, cfg.alpha)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, out)
    log.info("slot pictures of %s: %s", cfg.ckpt_path, out)
    return out
