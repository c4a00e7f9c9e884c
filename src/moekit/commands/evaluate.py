"""``scripts/eval.py``: test a checkpoint; the network and, unless ``data`` is given, the dataset come from it."""

from __future__ import annotations

import logging

import lightning as L
from lightning import Trainer
from omegaconf import DictConfig

from moekit.checkpoint import load_task
from moekit.configs import check_target_keys, instantiate, instantiate_group
from moekit.errors import check_writable_dir, storage_errors
from moekit.utils.machine import check_accelerator

from .common import choose_precision, datamodule_for, floats, signal_ends_phase, where

log = logging.getLogger("moekit")

__all__ = ["evaluate"]


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test a checkpoint: the network and, unless ``data`` is set, the dataset come from it."""
    module = load_task(cfg.ckpt_path)
    L.seed_everything(cfg.seed, workers=True)
    choose_precision(cfg, checkpoint=cfg.ckpt_path)  # "auto": as the run trained (and tested) it, where native
    check_target_keys(cfg.trainer, "trainer")
    check_accelerator(cfg.trainer.get("accelerator", "auto"), cfg.trainer.get("devices", "auto"))
    output_dir = check_writable_dir(cfg.paths.output_dir, "paths.output_dir")
    datamodule = datamodule_for(cfg, module)
    loggers = instantiate_group(cfg.get("logger"), "logger")
    trainer: Trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=[])
    with storage_errors(output_dir), signal_ends_phase("the test", "rerun the command"):
        trainer.test(module, datamodule=datamodule)
    metrics = floats(trainer.callback_metrics)
    log.info("done.\n  %s", where(trainer))
    return metrics
