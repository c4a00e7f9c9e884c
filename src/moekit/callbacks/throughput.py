"""Training throughput in samples per second, logged to every logger."""

from __future__ import annotations

import time

from lightning import Callback, LightningModule, Trainer

__all__ = ["ThroughputLogger"]


class ThroughputLogger(Callback):
    """Logs ``train/<unit>_per_sec`` (also shown in the progress bar): samples processed between two
    logging points divided by the wall time between them (data loading included, as a user experiences
    it). The first batch of each epoch only starts the clock, so compilation and worker start-up do not
    count.

    Args:
        unit: name of one sample in the metric (``images``, ``tokens``).
        count: how a batch's first tensor counts samples: ``"rows"`` (its dim 0: images) or
            ``"elements"`` (all its entries: the tokens of ``[batch, seq_len]`` ids).
        samples_fn: maps a batch to its number of samples; overrides ``count`` (from Python).
    """

    def __init__(self, unit: str = "images", count: str = "rows", samples_fn=None) -> None:
        if count not in ("rows", "elements"):
            raise ValueError(f"ThroughputLogger count={count!r}; allowed: 'rows', 'elements'")
        self.unit = unit
        if samples_fn is None:
            samples_fn = (lambda batch: batch[0].shape[0]) if count == "rows" else (lambda batch: batch[0].numel())
        self.samples_fn = samples_fn
        self._start: float | None = None
        self._samples = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = None
        self._samples = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._start is None:
            self._start = now
            return
        self._samples += self.samples_fn(batch)
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            elapsed = now - self._start
            if elapsed > 0 and self._samples:
                pl_module.log(
                    f"train/{self.unit}_per_sec", self._samples / elapsed, on_step=True, on_epoch=False, prog_bar=True
                )
            self._start = now
            self._samples = 0
