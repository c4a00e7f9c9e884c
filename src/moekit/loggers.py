"""Loggers whose history survives a kill and a resume: ``metrics.csv`` and the TensorBoard scalars of a resumed
run equal the uninterrupted run's, step for step.

- **A checkpoint never precedes its own logs.** Lightning writes a checkpoint in ``on_train_batch_end`` (or
  ``on_train_epoch_end``) and logs that step's (or epoch's) row only afterwards, so a kill right after the
  write, or a pre-emption save, lost the row for good. :func:`log_before_checkpoint` logs that row before the
  checkpoint is written; when Lightning logs it again, the loggers here drop the repeat (same step, values).
- **A checkpoint records how far the logs went** (:func:`log_positions`: rows of ``metrics.csv``, bytes of each
  TensorBoard event file, after a flush). A run resumed from it into the same folder first cuts the logs back
  to those positions (:func:`resume_logs`): whatever the killed run logged after its checkpoint is dropped and
  logged again by the resumed run, once. A resumed run cannot cut by step instead: after a checkpoint written
  at the end of a validation it logs the rest of that same step (the epoch's means).
- **Files are rewritten atomically**, and a CSV line cut short by a kill is dropped.

:class:`ResumableCSVLogger` (``configs/logger/csv.yaml``): Lightning's ``CSVLogger`` deletes ``metrics.csv``
when its writer opens a folder that holds one (``_ExperimentWriter._check_log_dir_exists``). This one keeps the
file, its header becoming the writer's known columns; a metric the file has no column for rewrites it once with
the wider header (old rows get empty cells there). A run that is not resumed from a checkpoint with positions
(a fresh run in the folder) keeps the earlier rows of steps before its first step: a fresh run replaces the
file, as Lightning's does. :class:`ResumableTensorBoardLogger` (``configs/logger/tensorboard.yaml``): each run
writes its own event file beside the earlier ones, which a resume cuts back.

:class:`MLFlowLogger`, :class:`WandbLogger` (``configs/logger/mlflow.yaml``, ``wandb.yaml``): a
tracking store's history cannot be cut back. Their position is their run's id, and a resumed run logs into that run
(:func:`continue_runs`, before the loggers start). What the killed run logged after its checkpoint stays: MLflow
leaves out a re-logged value the run holds at that step already (deterministic training: all of them) and keeps
both values of one that differs, the resumed one latest; W&B keeps both rows of a re-logged ``trainer/global_step``.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch import loggers as pl_loggers
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from moekit.utils.atomic import atomic_write, write_text_atomic

__all__ = [
    "MLFlowLogger",
    "ResumableCSVLogger",
    "ResumableExperimentWriter",
    "ResumableTensorBoardLogger",
    "WandbLogger",
    "continue_runs",
    "log_before_checkpoint",
    "logging_step",
    "log_positions",
    "read_metrics_csv",
    "resume_logs",
]

log = logging.getLogger("moekit")


def logging_step(trainer: Any) -> int:
    """The step Lightning logs a training step's metrics at (the optimizer steps taken before it): every
    callback that logs its own figures uses it, so that they line up with Lightning's in TensorBoard."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def log_before_checkpoint(trainer: Any) -> None:
    """Log now the row that Lightning logs right after the hook in which a checkpoint is being written: the
    step's row when the checkpoint is written in ``on_train_batch_end``, the epoch's row in ``on_train_epoch_end``
    (and nothing at other moments). Call it while the checkpoint is being built, before the file is written.

    The row is the one Lightning's ``_LoggerConnector`` would log (its ``metrics["log"]``, with ``epoch`` added,
    at the step it would use), so the loggers here recognise Lightning's own call as a repeat."""
    if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or not trainer.loggers:
        return
    fit_loop, connector = trainer.fit_loop, trainer._logger_connector
    batches, epochs = fit_loop.epoch_loop.batch_progress.current, fit_loop.epoch_progress.current
    step = logging_step(trainer)
    if batches.processed == batches.completed + 1:  # on_train_batch_end: the step's row comes after it
        if fit_loop._should_accumulate() or not connector.should_update_logs:
            return
    elif epochs.processed == epochs.completed + 1:  # on_train_epoch_end: the epoch's row, at its last step
        step -= 1
    else:
        return
    metrics = convert_tensors_to_scalars(connector.metrics["log"])
    if not metrics:
        return
    metrics.setdefault("epoch", trainer.current_epoch)
    for logger in trainer.loggers:
        if isinstance(logger, _DROP_REPEATS):  # they drop Lightning's repeat; other loggers get the row from it
            logger.log_metrics(metrics, step=step)
            logger.save()


def _position_key(logger: Any) -> str:
    """The key of ``logger``'s position in a checkpoint: its ``position_key`` (MLflow, W&B), else its log folder."""
    return getattr(logger, "position_key", None) or logger.log_dir


def log_positions(trainer: Any) -> dict[str, Any]:
    """``{log folder or store: position}`` of the trainer's loggers that can cut their logs back
    (:func:`resume_logs`, taken after a flush) or continue their run (:func:`continue_runs`: the run's id); stored
    in each checkpoint."""
    return {
        _position_key(logger): logger.position()
        for logger in trainer.loggers
        if callable(getattr(logger, "position", None))
    }


def resume_logs(trainer: Any, positions: Mapping[str, Any]) -> None:
    """Cut the logs of the trainer's loggers back to ``positions`` (:func:`log_positions` of the checkpoint a
    run resumes from); a logger whose folder the checkpoint does not know is left alone."""
    for logger in trainer.loggers:
        if callable(getattr(logger, "resume_from", None)) and _position_key(logger) in positions:
            logger.resume_from(positions[_position_key(logger)])


def continue_runs(loggers: list[Any], positions: Mapping[str, Any]) -> None:
    """Make the MLflow and W&B loggers log into the run recorded in ``positions`` (:func:`log_positions` of the
    checkpoint a run resumes from), before they start (``trainer.fit`` starts them before it reads the checkpoint);
    a logger whose store the checkpoint does not know opens a new run."""
    for logger in loggers:
        position = positions.get(getattr(logger, "position_key", None) or "")
        if callable(getattr(logger, "continue_run", None)) and isinstance(position, Mapping) and position.get("id"):
            logger.continue_run(position)


class _Repeats:
    """The rows logged at the latest step, to recognise a row logged again (same step, same values)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.rows: list[list[tuple[str, str]]] = []

    def seen(self, metrics: Mapping[str, Any], step: int | None) -> bool:
        """Whether ``metrics`` were logged at ``step`` already; records them if not."""
        row = sorted((name, repr(value)) for name, value in metrics.items())  # repr: NaN equals NaN
        if step != self.step:
            self.step, self.rows = step, []
        if row in self.rows:
            return True
        self.rows.append(row)
        return False


def _repeats(logger: Any) -> _Repeats:
    """The logger's :class:`_Repeats` (made at first use: the loggers keep Lightning's ``__init__``, whose
    signature Hydra configs are checked against)."""
    if "_moekit_repeats" not in logger.__dict__:
        logger._moekit_repeats = _Repeats()
    return logger._moekit_repeats


def read_metrics_csv(text: str) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of a ``metrics.csv`` text, without a last line left incomplete by a kill
    during a write (one that does not end with a line break). No complete header: ``([], [])``."""
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    header = list(reader.fieldnames or [])
    return header, list(reader) if header else []


def _step(row: dict[str, str]) -> int | None:
    """The ``step`` of a row read from ``metrics.csv``; None when it has none that reads as a number."""
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


def _csv_text(header: list[str], rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=header, extrasaction="ignore")  # ignore: cells past the header
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


class ResumableExperimentWriter(ExperimentWriter):
    """Lightning's CSV experiment writer that continues an existing ``metrics.csv`` (see the module
    docstring). Holds ``resumed``: whether the folder had a ``metrics.csv`` when the writer opened it,
    and ``replaced_rows``: how many earlier rows its first save dropped as superseded."""

    def __init__(self, log_dir: str) -> None:
        self.resumed = False
        self.replaced_rows = 0
        self.keep_rows: int | None = None  # set by a resume: the rows the checkpoint saw; None: cut by step
        self._pending_merge = False
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        """Keep an existing ``metrics.csv`` (Lightning deletes it here) and take its columns."""
        if not self._fs.isfile(self.metrics_file_path):
            return
        header, _ = read_metrics_csv(self._read_text())
        self.metrics_keys = header
        self.resumed = self._pending_merge = True

    def _read_text(self) -> str:
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            return file.read()

    def _write_text(self, text: str) -> None:
        if isinstance(self._fs, LocalFileSystem):
            write_text_atomic(self.metrics_file_path, text)
        else:  # a remote file system: its own write (no atomic rename there)
            with self._fs.open(self.metrics_file_path, "w", newline="") as file:
                file.write(text)

    def row_count(self) -> int:
        """The rows in the file (the buffer saved first)."""
        self.save()
        return len(read_metrics_csv(self._read_text())[1]) if self._fs.isfile(self.metrics_file_path) else 0

    def _merge_earlier_rows(self) -> None:
        """Rewrite the existing file with the earlier rows the new run continues: the first ``keep_rows``, or
        without that the rows of steps before the new run's first step; under a header that also holds the new
        run's columns."""
        header, rows = read_metrics_csv(self._read_text())
        if self.keep_rows is not None:
            kept, why = rows[: self.keep_rows], "logged after the checkpoint this run resumes from"
        else:
            first_step = min(row["step"] for row in self.metrics)
            kept = [row for row in rows if (_step(row) is None or _step(row) < first_step)]
            why = f"of steps >= {first_step}, which this run logs again"
        self.replaced_rows = len(rows) - len(kept)
        self.metrics_keys = sorted(set(header).union(*self.metrics))
        self._write_text(_csv_text(self.metrics_keys, kept))
        if self.replaced_rows:
            log.info("%s: dropped %d rows %s", self.metrics_file_path, self.replaced_rows, why)

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        """Lightning's rewrite for new columns, through a temporary file."""
        _, rows = read_metrics_csv(self._read_text())
        self._write_text(_csv_text(fieldnames, rows))

    def save(self) -> None:
        if self.metrics and self._pending_merge and self._fs.isfile(self.metrics_file_path):
            self._merge_earlier_rows()
        if self.metrics:
            self._pending_merge = False
        super().save()


class ResumableCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` whose ``metrics.csv`` keeps the rows of earlier runs in
    the same folder up to the step the new run starts at (see the module docstring). Same arguments.

    It also writes its buffered rows whenever a checkpoint is saved, so the rows logged before a
    checkpoint are on disk once the checkpoint is."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ResumableExperimentWriter:
        """The writer (created at first use, like Lightning's)."""
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ResumableExperimentWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not _repeats(self).seen(metrics, step):
            super().log_metrics(metrics, step)

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.save()

    def position(self) -> int | None:
        """How many rows ``metrics.csv`` holds (rank 0; None on other ranks)."""
        return self.experiment.row_count() if rank_zero_only.rank == 0 else None

    @rank_zero_only
    def resume_from(self, rows: int | None) -> None:
        """Keep only the first ``rows`` rows of the existing ``metrics.csv`` (at this run's first save)."""
        if rows is not None:
            self.experiment.keep_rows = rows


def cut_event_file(path: str | Path, size: int) -> bool:
    """Cut the TensorBoard event file ``path`` back to its first ``size`` bytes (a size it had after a flush:
    a record boundary), atomically; a file that is not longer is left alone. Returns whether it was cut."""
    path = Path(path)
    if path.stat().st_size <= size:
        return False
    with open(path, "rb") as file:
        head = file.read(size)
    with atomic_write(path, "wb") as file:
        file.write(head)
    return True


class ResumableTensorBoardLogger(TensorBoardLogger):
    """``lightning.pytorch.loggers.TensorBoardLogger`` for runs resumed into their own folder (see the module
    docstring): a resume cuts the event files of earlier runs back to the sizes its checkpoint recorded and
    removes those the checkpoint did not know (written after it); a row logged again at the same step with the
    same values is dropped. Same arguments."""

    _earlier_files: list[Path] | None = None  # the event files in the folder before this run's writer

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The ``SummaryWriter`` (created at first use, like Lightning's)."""
        if self._experiment is None and self._earlier_files is None:
            self._earlier_files = sorted(Path(self.log_dir).glob("events.out.tfevents.*"))
        return TensorBoardLogger.experiment.fget(self)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not _repeats(self).seen(metrics, step):
            super().log_metrics(metrics, step)

    def position(self) -> dict[str, int] | None:
        """``{event file name: size}`` of the folder's event files after a flush (rank 0; None on other ranks)."""
        if rank_zero_only.rank != 0:
            return None
        self.experiment.flush()
        return {path.name: path.stat().st_size for path in Path(self.log_dir).glob("events.out.tfevents.*")}

    @rank_zero_only
    def resume_from(self, sizes: Mapping[str, int] | None) -> None:
        """Cut the earlier runs' event files back to ``sizes``; remove those not in it."""
        if sizes is None:
            return
        self.experiment  # noqa: B018 - lists the earlier files before this run's writer adds its own
        for path in self._earlier_files or []:
            if path.name not in sizes:
                path.unlink(missing_ok=True)
                log.info("removed %s, written after the checkpoint this run resumes from", path)
            elif cut_event_file(path, sizes[path.name]):
                log.info("%s: dropped the events logged after the checkpoint this run resumes from", path)


class MLFlowLogger(pl_loggers.MLFlowLogger):
    """Lightning's ``MLFlowLogger`` (same name, by which the config checks know its package; same arguments) that a
    resumed run continues (see the module docstring): ``RUNNING`` again until it ends, the first run's parameters
    kept (MLflow refuses a change; ``ckpt_path`` changes), a checkpoint's row logged before the checkpoint."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._continued, self._last_step, self._logged = False, None, {}  # see continue_run and log_metrics

    @property
    def position_key(self) -> str:
        return f"mlflow:{self._tracking_uri}"

    def position(self) -> dict[str, Any] | None:
        """``{"id": run id, "step": latest step logged}`` (rank 0; None on other ranks)."""
        return {"id": self.run_id, "step": self._last_step} if rank_zero_only.rank == 0 else None

    @rank_zero_only
    def continue_run(self, position: Mapping[str, Any]) -> None:
        """Log into the run ``position["id"]`` of this tracking store and read the values it holds from
        ``position["step"]`` on; a run the store does not hold (or holds deleted) is said so, and a new run opened."""
        from mlflow.exceptions import MlflowException

        run_id, step = str(position["id"]), position.get("step")
        if self._initialized:
            raise RuntimeError(f"MLflow run {self._run_id} has started; continue run {run_id} before it starts")
        try:
            run = self._mlflow_client.get_run(run_id)
        except MlflowException as err:
            run, why = None, str(err).split("\n")[0]
        else:
            why = "it is deleted"
        if run is None or run.info.lifecycle_stage == "deleted":
            log.warning("MLflow run %s of %s not continued (%s); logging to a new run", run_id, self._tracking_uri, why)
            return
        self._run_id, self._continued, self._last_step, self._logged = run_id, True, step, {}
        for key in run.data.metrics if step is not None else ():
            for metric in self._mlflow_client.get_metric_history(run_id, key):
                if metric.step >= step:
                    self._logged.setdefault((key, metric.step), []).append(metric.value)
        self._mlflow_client.update_run(run_id, status="RUNNING")
        log.info("MLflow: continuing run %s of %s", run_id, self._tracking_uri)

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        if self._continued:
            logged = self.experiment.get_run(self.run_id).data.params
            flat = _flatten_dict(_convert_params(params))
            changed = sorted(k for k, v in flat.items() if k in logged and logged[k] != str(v)[:250])
            if changed:
                log.info("MLflow run %s keeps the first values of %s", self.run_id, ", ".join(changed))
            params = {k: v for k, v in flat.items() if k not in logged}
        if params:
            super().log_hyperparams(params)

    def _logged_already(self, name: str, value: Any, step: int) -> bool:
        """Whether the continued run holds ``value`` at ``step`` (each held value matches once)."""
        key = re.sub("[^a-zA-Z0-9_/. -]+", "", f"{self._prefix}{self.LOGGER_JOIN_CHAR}{name}" if self._prefix else name)
        held = self._logged.get((key, step), [])
        match = next((i for i, v in enumerate(held) if v == value or (math.isnan(v) and math.isnan(value))), None)
        return match is not None and held.pop(match) is not None

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if _repeats(self).seen(metrics, step):
            return
        if self._logged and step is not None:
            metrics = {k: v for k, v in metrics.items() if isinstance(v, str) or not self._logged_already(k, v, step)}
        if metrics:
            super().log_metrics(metrics, step)
        if step is not None:
            self._last_step = max(step, self._last_step if self._last_step is not None else step)


class WandbLogger(pl_loggers.WandbLogger):
    """Lightning's ``WandbLogger`` (same name and arguments) that a resumed run continues (its run id, resume "allow";
    offline, each process writes an ``offline-run-<time>-<id>`` folder); a checkpoint's row logged before it."""

    @property
    def position_key(self) -> str:
        return f"wandb:{self._project}"

    def position(self) -> dict[str, str] | None:
        """``{"id": run id}`` (rank 0; None on other ranks)."""
        return {"id": self.version} if rank_zero_only.rank == 0 else None

    @rank_zero_only
    def continue_run(self, position: Mapping[str, Any]) -> None:
        """Log into the run ``position["id"]`` (W&B creates it when its project does not hold it)."""
        run_id = str(position["id"])
        if self._experiment is not None:
            raise RuntimeError(f"W&B run {self._experiment.id} has started; continue run {run_id} before it starts")
        self._id = self._wandb_init["id"] = run_id
        self._wandb_init["resume"] = self._wandb_init.get("resume") or "allow"
        log.info("W&B: continuing run %s of project %s", run_id, self._project)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not _repeats(self).seen(metrics, step):
            super().log_metrics(metrics, step)


_DROP_REPEATS = (ResumableCSVLogger, ResumableTensorBoardLogger, MLFlowLogger, WandbLogger)
