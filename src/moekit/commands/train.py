"""``scripts/train.py``: fit the task on the data, test the best checkpoint, write the run record."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning import Callback, LightningDataModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from moekit.analysis.records import RESULTS_FILE, build_run_record
from moekit.callbacks import RoutingReport, ThroughputMonitor
from moekit.checkpoint import check_ckpt_path
from moekit.configs import check_target_keys, instantiate, instantiate_group
from moekit.errors import check_writable_dir, storage_errors
from moekit.loggers import continue_runs
from moekit.models.summary import LMSummary, ModelSummary, lm_summary, model_summary
from moekit.resume import RESUME_ALIASES, check_resume_checkpoint, find_resume_checkpoint
from moekit.tasks import ImageClassifier, LanguageModel, MoETask
from moekit.tasks.base import LOG_POSITIONS_KEY
from moekit.utils.atomic import remove_stale_temporaries, write_json_atomic
from moekit.utils.machine import check_accelerator

from .common import apply_kernel_choices, check_trainer_keys, choose_precision, floats, signal_ends_phase, where

log = logging.getLogger("moekit")

SUMMARY_BATCH = 16
"""The largest batch the run's model summary measures its FLOPs on: routing whose capacity counts a whole batch or
position (experts-choice, strictly balanced gating, position-scope capacities) measures nearer its training
work than at 2 sequences (at 2, a capacity's minimum of one token can give every token several times k experts),
and the measurement stays cheap."""

__all__ = ["run", "train"]


def run(cfg: DictConfig) -> dict[str, float] | float:
    """``scripts/train.py``: :func:`train`; returns its metrics, or, with ``optimized_metric`` set (a sweeper such
    as Optuna reads the value), that metric's best value over the run (``best/<name>``, when the best checkpoint
    is chosen by it) or its final value."""
    metrics = train(cfg)
    name = cfg.get("optimized_metric")
    if not name:
        return metrics
    value = metrics.get(f"best/{name}", metrics.get(name))
    if value is None:
        raise ValueError(
            f"optimized_metric={name!r} is not a metric of this run; it has {', '.join(sorted(metrics))}. Name one "
            "of them (with test=true the test metrics count too)"
        )
    return value


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the task on the data, then test the best checkpoint. Returns the final metrics (and the best
    checkpoint's score as ``best/<monitored metric>``) and writes them with the model's size, FLOPs, time and
    machine to ``<paths.output_dir>/results.json``."""
    L.seed_everything(cfg.seed, workers=True)
    for name in ("data", "model", "task"):
        check_target_keys(cfg.get(name), name)
    check_trainer_keys(cfg.trainer)
    check_accelerator(cfg.trainer.get("accelerator", "auto"), cfg.trainer.get("devices", "auto"))
    apply_kernel_choices(cfg)
    output_dir = check_writable_dir(cfg.paths.output_dir, "paths.output_dir")
    if cfg.get("ckpt_path") in RESUME_ALIASES:
        _resolve_resume_alias(cfg, output_dir)
    check_ckpt_path(cfg.get("ckpt_path"), sharded_ok=True)
    _remove_stale_checkpoint_writes(output_dir, cfg.get("ckpt_path"))
    datamodule: LightningDataModule = instantiate(cfg.data, _convert_="all")
    # "auto" -> this machine's (a resumed run's: its own), before the run record holds it
    precision_reason = choose_precision(cfg, datamodule, checkpoint=cfg.get("ckpt_path"))
    run_config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    module = instantiate(cfg.task, net=cfg.model, run_config=run_config, _recursive_=False)
    # where the checkpoint's logs end; MLflow / W&B log into its run, which they open before fit reads it
    positions = check_resume_checkpoint(cfg.ckpt_path, module).get(LOG_POSITIONS_KEY) if cfg.get("ckpt_path") else None
    callbacks: list[Callback] = instantiate_group(cfg.get("callbacks"), "callbacks")
    counter = next((c for c in callbacks if isinstance(c, ThroughputMonitor)), None)
    if counter is None:  # the run record needs the counts even without the throughput logs
        counter = ThroughputMonitor(count="elements" if isinstance(module, LanguageModel) else "rows", log=False)
        callbacks.append(counter)
    loggers: list[Logger] = instantiate_group(cfg.get("logger"), "logger")
    continue_runs(loggers, positions or {})
    trainer: Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    summary = _summary(module, datamodule)
    log.info("model: %s", summary if summary is not None else f"{type(module.net).__name__} (summary unavailable)")
    metrics: dict[str, float] = {}
    with storage_errors(output_dir):
        if cfg.get("train", True):
            resume = f"resume from its last checkpoint: ckpt_path={output_dir / 'checkpoints' / 'last.ckpt'}"
            with signal_ends_phase("training", resume):  # without the pre-emption callback (callbacks=none)
                trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            metrics.update(floats(trainer.callback_metrics))
            checkpoint = trainer.checkpoint_callback
            if getattr(checkpoint, "monitor", None) and getattr(checkpoint, "best_model_score", None) is not None:
                metrics[f"best/{checkpoint.monitor}"] = float(checkpoint.best_model_score)
        if cfg.get("test", True):
            best = getattr(trainer.checkpoint_callback, "best_model_path", "") if cfg.get("train", True) else ""
            rerun = f"the training is complete: test it with python scripts/eval.py ckpt_path={best}" if best else ""
            with signal_ends_phase("the test phase", rerun or "rerun the command"):
                trainer.test(module, datamodule=datamodule, ckpt_path=best or None, weights_only=False)
            metrics.update(floats(trainer.callback_metrics))
        if trainer.is_global_zero:
            record = build_run_record(
                run_config=run_config,
                overrides=_hydra_overrides(),
                net=module.net,
                summary=summary,
                counter=counter,
                metrics=metrics,
                trainer=trainer,
                precision_reason=precision_reason,
            )
            report = next((c for c in callbacks if isinstance(c, RoutingReport)), None)
            if report is not None and report.layers:
                record["routing"] = report.summary()
            write_json_atomic(output_dir / RESULTS_FILE, record)
    log.info("done.\n  %s\n  run record: %s", where(trainer), output_dir / RESULTS_FILE)
    return metrics


def _resolve_resume_alias(cfg: DictConfig, output_dir: Path) -> None:
    """Replace ``ckpt_path=last`` / ``auto`` with the checkpoint it means (:func:`find_resume_checkpoint`, over
    the runs beside this one: ``<paths.log_dir>/<task_name>/runs``, with ``debug=``
    ``<paths.log_dir>/debug/<task_name>/runs``; a sweep's job: its own folder only), and say which; ``auto``
    without one: None."""
    alias = cfg.ckpt_path
    in_sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    runs_dir = None if in_sweep else output_dir.parent
    found, skipped = find_resume_checkpoint(alias, output_dir, runs_dir)
    for path in skipped:
        log.warning("ckpt_path=%s: skipped %s, which does not load", alias, path)
    if found is None:
        log.info("ckpt_path=auto: no checkpoint under %s; starting afresh", runs_dir or output_dir)
    else:
        log.info("ckpt_path=%s: resuming from %s", alias, found)
    with open_dict(cfg):
        cfg.ckpt_path = None if found is None else str(found)


# A checkpoint write keeps its temporary file growing until the rename: one untouched this long is a dead write's.
FOREIGN_WRITE_IDLE_S = 600.0


def _remove_stale_checkpoint_writes(output_dir: Path, ckpt_path: str | None) -> None:
    """Rank 0 removes the temporary files of checkpoint writes that a kill interrupted: all of them in this run's
    checkpoint folder; in the folder of a checkpoint it branches from (another run's, which may still be training),
    those untouched for :data:`FOREIGN_WRITE_IDLE_S` seconds."""
    if rank_zero_only.rank != 0:
        return
    own = output_dir / "checkpoints"
    folders = {own.resolve(): 0.0}
    if ckpt_path and Path(ckpt_path).is_file():
        folders.setdefault(Path(ckpt_path).parent.resolve(), FOREIGN_WRITE_IDLE_S)
    for folder, idle_for in sorted(folders.items()):
        for path in remove_stale_temporaries(folder, idle_for):
            log.info("removed %s, left by a checkpoint write that was interrupted", path)


def _summary(module: MoETask, datamodule: LightningDataModule) -> ModelSummary | LMSummary | None:
    """The network's parameters and forward FLOPs per image (:func:`~moekit.models.summary.model_summary`)
    or per token (:func:`~moekit.models.summary.lm_summary`), measured on a batch of the training batch size up to
    ``SUMMARY_BATCH`` (a capacity over the whole batch or its positions routes as in training); None when they
    cannot be measured (the summary is informative: the run goes on)."""
    batch = min(datamodule.batch_size, SUMMARY_BATCH)
    try:
        if isinstance(module, ImageClassifier):
            size = (datamodule.in_chans, datamodule.img_size, datamodule.img_size)
            return model_summary(module.net, input_size=size, batch_size=batch)
        return lm_summary(module.net, seq_len=datamodule.seq_len, batch_size=batch)
    except Exception as err:
        log.warning("model summary unavailable: %s: %s", type(err).__name__, err)
        return None


def _hydra_overrides() -> list[str]:
    """The run's command-line and sweep overrides (``hydra.overrides.task``); [] outside Hydra."""
    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)
