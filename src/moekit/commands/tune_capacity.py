"""``scripts/tune_capacity_demo.py``: train ``experiment=capacity_tuning`` with the capacity tuner, then draw
each MoE layer's drop rate and capacity factor against the step (:mod:`moekit.analysis.capacity_tuning`)."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from moekit.analysis.capacity_tuning import plot_capacity_tuning, read_capacity_scalars, summarize_capacity_tuning

from .train import train

log = logging.getLogger("moekit")

__all__ = ["tune_capacity_demo"]


def tune_capacity_demo(cfg: DictConfig) -> Path:
    """Train, then write the figure to ``cfg.figure`` and log the per-layer summary; returns the figure's path."""
    train(cfg)
    history = read_capacity_scalars(Path(cfg.paths.output_dir))
    target = float(cfg.callbacks.capacity_tuner.target_drop)
    figure = Path(cfg.figure)
    plot_capacity_tuning(history, target, figure)
    log.info("capacity tuning (target %g):\n%s\nfigure: %s", target, summarize_capacity_tuning(history, target), figure)
    return figure
