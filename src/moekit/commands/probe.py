"""``scripts/linear_probe.py``: the few-shot linear probe of a checkpoint's frozen network (the Soft MoE paper's
10-shot protocol, :mod:`moekit.tasks.fewshot`)."""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from moekit.checkpoint import load_task
from moekit.tasks import ImageClassifier
from moekit.tasks.fewshot import check_shots, fewshot_linear_probe

from .common import datamodule_for

log = logging.getLogger("moekit")

__all__ = ["linear_probe"]


def linear_probe(cfg: DictConfig) -> float:
    """Few-shot linear probe of a checkpoint's frozen network (see :mod:`moekit.tasks.fewshot`)."""
    check_shots(cfg.shots)  # before loading the checkpoint
    module = load_task(cfg.ckpt_path)
    if not isinstance(module, ImageClassifier):
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} holds a {type(module).__name__}, not an image classifier: the linear probe "
            "fits a classifier on a ViT's image features; give the checkpoint of an image experiment"
        )
    datamodule = datamodule_for(cfg, module, same_labels=False)  # the probe fits its own classifier
    result = fewshot_linear_probe(module.net, datamodule, shots=cfg.shots, seed=cfg.seed)
    log.info("%s", result)
    return result.accuracy
