"""``scripts/tune_capacity_demo.py``: train ``experiment=capacity_tuning`` with the capacity tuner, then draw
each MoE layer's drop rate and capacity factor against the step (:mod:`moekit.analysis.capacity_tuning`)."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moekit.analysis.capacity_tuning import plot_capacity_tuning, read_capacity_scalars, summarize_capacity_tuning

from .train import train

log = logging.getLogger("moekit")

__all__ = ["tune_capacity_demo"]


def tune_capacity_demo(cfg: DictConfig) -> Path:
    """Train, then write the figure to ``cfg.figure`` and log the per-layer summary; returns the figure's path.

    Raises:
        ValueError: before training, when the run has no capacity tuner or no logger the history can be read from.
    """
    if OmegaConf.select(cfg, "callbacks.capacity_tuner") is None:
        raise ValueError(
            "tune_capacity_demo: the run has no callbacks.capacity_tuner, so there is nothing to plot; keep the "
            "experiment's callbacks (or add capacity_tuner: 'callbacks=[default,capacity_tuner]')"
        )
    targets = [str(OmegaConf.select(logger, "_target_", default="")) for logger in (cfg.get("logger") or {}).values()]
    if not any(target.endswith(("TensorBoardLogger", "CSVLogger")) for target in targets):
        raise ValueError(
            "tune_capacity_demo: the tuner's history is read back from TensorBoard or metrics.csv, but the run logs "
            f"to {targets or 'no logger'}; log to one of them: logger=tensorboard, logger=csv or logger=many"
        )
    train(cfg)
    history = read_capacity_scalars(Path(cfg.paths.output_dir))
    target = float(cfg.callbacks.capacity_tuner.target_drop)
    figure = Path(cfg.figure)
    recipe, dataset = OmegaConf.select(cfg, "moe.name"), OmegaConf.select(cfg, "data.dataset")
    title = f"CapacityTuner: moe={recipe}" + (f" on {dataset}" if dataset else "")
    plot_capacity_tuning(history, target, figure, title=title)
    log.info("capacity tuning (target %g):\n%s\nfigure: %s", target, summarize_capacity_tuning(history, target), figure)
    return figure
