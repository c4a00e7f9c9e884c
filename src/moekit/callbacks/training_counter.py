"""Counts the examples a fit trains on and times it, for the run record (``results.json``)."""

from __future__ import annotations

import time

from lightning import Callback, LightningModule, Trainer

__all__ = ["TrainingCounter"]


class TrainingCounter(Callback):
    """Counts training examples and measures the wall time of ``trainer.fit``.

    :func:`moekit.run.train` adds one to every run (whatever ``callbacks`` says) and writes what it
    holds to ``results.json``. Counts are global: a batch counts ``world_size`` times its own size
    (every rank trains on a shard of the same size).

    Args:
        count: how a batch's first tensor counts examples: ``"rows"`` (dim 0: images) or
            ``"elements"`` (every entry: the tokens of ``[batch, seq_len]`` ids).

    Attributes:
        examples: examples of every training batch of this process's fit (a resumed run counts only
            the batches after the resume).
        batches: training batches of this process's fit.
        fit_seconds: wall time from the start to the end of fit (validation and checkpoints included),
            None before the fit ends.
        timed_seconds: the sum of the times between consecutive training-batch ends within an epoch
            (data loading included); the first batch of each epoch only starts the clock, as in
            :class:`~moekit.callbacks.ThroughputLogger`.
        timed_examples, timed_batches: examples and batches of those timed intervals.
    """

    def __init__(self, count: str = "rows") -> None:
        if count not in ("rows", "elements"):
            raise ValueError(f"TrainingCounter count={count!r}; allowed: 'rows', 'elements'")
        self.count = count
        self.examples = 0
        self.batches = 0
        self.fit_seconds: float | None = None
        self.timed_seconds = 0.0
        self.timed_examples = 0
        self.timed_batches = 0
        self._fit_start: float | None = None
        self._last_batch_end: float | None = None

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
        self._last_batch_end = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        examples = self.batch_examples(batch) * trainer.world_size
        self.examples += examples
        self.batches += 1
        if self._last_batch_end is not None:
            self.timed_seconds += now - self._last_batch_end
            self.timed_examples += examples
            self.timed_batches += 1
        self._last_batch_end = now
