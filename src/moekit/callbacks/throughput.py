"""Counting and timing what a fit trains on: the throughput in the logs and the totals of the run record."""

from __future__ import annotations

import time

from lightning import Callback, LightningModule, Trainer

__all__ = ["ThroughputMonitor"]


class ThroughputMonitor(Callback):
    """Counts the training examples and times the batches of a fit.

    The clock: the time between consecutive training-batch ends within an epoch (data loading included, as a
    user experiences it); the first batch of each epoch only starts it, so compilation and worker start-up do not
    count. Every ``trainer.log_every_n_steps`` steps it logs ``train/<unit>_per_sec`` (also in the progress bar):
    the examples of this process since the previous log over the time since then. ``scripts/train.py`` adds one
    with ``log=False`` when the callbacks config has none, for the run record (``results.json``).

    Args:
        unit: name of one example in the metric (``images``, ``tokens``).
        count: how a batch's first tensor counts examples: ``"rows"`` (its dim 0: images) or ``"elements"`` (all
            its entries: the tokens of ``[batch, seq_len]`` ids, padding included where batches carry a padding mask).
        log: log the throughput (False: count only).

    Attributes (totals of this process's fit; a resumed run counts only the batches after the resume):
        examples: examples of every training batch, times the world size (every rank trains on a shard of the
            same size).
        batches: training batches.
        fit_seconds: wall time from the start to the end of fit (validation and checkpoints included), None
            before the fit ends.
        timed_seconds, timed_examples, timed_batches: the clock's intervals and their examples and batches.
    """

    def __init__(self, unit: str = "images", count: str = "rows", log: bool = True) -> None:
        if count not in ("rows", "elements"):
            raise ValueError(f"ThroughputMonitor count={count!r}; allowed: 'rows', 'elements'")
        self.unit = unit
        self.count = count
        self.log = log
        self.examples = 0
        self.batches = 0
        self.fit_seconds: float | None = None
        self.timed_seconds = 0.0
        self.timed_examples = 0
        self.timed_batches = 0
        self._fit_start: float | None = None
        self._last_batch_end: float | None = None
        self._log_start: float | None = None
        self._log_examples = 0

    def batch_examples(self, batch) -> int:
        """Examples in one batch of this process (its first tensor's rows or elements)."""
        first = batch[0]
        return int(first.shape[0] if self.count == "rows" else first.numel())

    @property
    def mean_throughput(self) -> float | None:
        """Examples per second over the timed intervals; None when nothing was timed."""
        return self.timed_examples / self.timed_seconds if self.timed_seconds > 0 else None

    @property
    def mean_batch_seconds(self) -> float | None:
        """Mean seconds per training batch over the timed intervals; None when nothing was timed."""
        return self.timed_seconds / self.timed_batches if self.timed_batches else None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._fit_start is not None:
            self.fit_seconds = time.perf_counter() - self._fit_start

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_batch_end = self._log_start = None
        self._log_examples = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        examples = self.batch_examples(batch)
        self.examples += examples * trainer.world_size
        self.batches += 1
        if self._last_batch_end is None:  # the epoch's first batch starts the clock
            self._last_batch_end = self._log_start = now
            return
        self.timed_seconds += now - self._last_batch_end
        self.timed_examples += examples * trainer.world_size
        self.timed_batches += 1
        self._last_batch_end = now
        self._log_examples += examples
        if self.log and trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            elapsed = now - self._log_start
            if elapsed > 0:
                throughput = self._log_examples / elapsed
                pl_module.log(f"train/{self.unit}_per_sec", throughput, on_step=True, on_epoch=False, prog_bar=True)
            self._log_start, self._log_examples = now, 0
