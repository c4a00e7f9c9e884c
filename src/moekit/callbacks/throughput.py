"""Training throughput in samples per second, logged to every logger."""

from __future__ import annotations

import time

from lightning import Callback, LightningModule, Trainer

__all__ = ["ThroughputLogger"]


class ThroughputLogger(Callback):
    """Logs ``train/<unit>_per_sec``: samples processed between two logging points divided by the
    wall time between them (data loading included, as a user experiences it). The first batch of
    each epoch only starts the clock, so compilation and worker start-up do not count.

    Args:
        unit: name of one sample in the metric (``images``, ``tokens``).
        samples_fn: maps a batch to its number of samples (default: size of its first tensor's dim 0;
            for language models pass e.g. ``lambda batch: batch[0].numel()`` to count tokens).
    """

    def __init__(self, unit: str = "images", samples_fn=None) -> None:
        self.unit = unit
        self.samples_fn = samples_fn or (lambda batch: batch[0].shape[0])
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
                pl_module.log(f"train/{self.unit}_per_sec", self._samples / elapsed, on_step=True, on_epoch=False)
            self._start = now
            self._samples = 0
