"""A CSV logger whose ``metrics.csv`` survives a run resumed into the same folder.

Lightning's ``CSVLogger`` deletes ``metrics.csv`` when its writer opens a log folder that already
holds one (``_ExperimentWriter._check_log_dir_exists``), so a run resumed with
``ckpt_path=<run>/checkpoints/last.ckpt`` into its own folder (the same ``paths.output_dir``) loses every
row logged before the interruption. :class:`ResumableCSVLogger` (``configs/logger/csv.yaml``) keeps them:

- an existing ``metrics.csv`` is kept and its header becomes the writer's known columns, so new rows
  are appended under it; a metric the file has no column for rewrites the file once with the wider
  header (Lightning's own path for new columns), old rows getting empty cells there;
- at the first save of the new run, the earlier rows at steps the new run logs again are dropped: a
  run resumed from a checkpoint of step ``s`` repeats every step from ``s`` on, so the earlier rows of
  those steps (logged by the interrupted run after its last checkpoint) are superseded. The file then
  holds one history, the rows of the uninterrupted run. "Steps the new run logs again" means the steps
  from the smallest step in its first save; a fresh (not resumed) run in the same folder starts at
  step 0 and so replaces the whole file, as Lightning's logger does;
- a last line cut short by a kill during a write is dropped, and every rewrite of the file goes through
  a temporary file and ``os.replace``, so a kill during the rewrite leaves the previous file whole.

TensorBoard needs none of this: each run adds its own event file beside the earlier ones.
"""

from __future__ import annotations

import csv
import io
import logging
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from moekit.utils.atomic import write_text_atomic

__all__ = ["ResumableCSVLogger", "ResumableExperimentWriter", "read_metrics_csv"]

log = logging.getLogger("moekit")


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

    def _merge_earlier_rows(self) -> None:
        """Rewrite the existing file with the earlier rows of steps before the new run's first step,
        under a header that also holds the new run's columns."""
        header, rows = read_metrics_csv(self._read_text())
        first_step = min(row["step"] for row in self.metrics)
        kept = [row for row in rows if (_step(row) is None or _step(row) < first_step)]
        self.replaced_rows = len(rows) - len(kept)
        self.metrics_keys = sorted(set(header).union(*self.metrics))
        self._write_text(_csv_text(self.metrics_keys, kept))
        if self.replaced_rows:
            log.info(
                "%s: replaced %d rows of steps >= %d logged before the resume",
                self.metrics_file_path,
                self.replaced_rows,
                first_step,
            )

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
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.save()
