"""Counting and timing what a fit trains on: the throughput in the logs and the totals of the run record."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning import Callback, LightningModule, Trainer
from torch import Tensor

__all__ = ["ThroughputMonitor"]


class ThroughputMonitor(Callback):
    """Counts the training examples and times the batches of a fit.

    The clock: the time between consecutive training-batch ends within an epoch (data loading included, as a
    user experiences it); the first batch of each epoch only starts it, so compilation and worker start-up do not
    count, and it stops during a validation within the epoch (``trainer.val_check_interval``). Every
    ``trainer.log_every_n_steps`` optimizer steps (at the batch that ends the step, under gradient accumulation) it
    logs ``train/<unit>_per_sec`` (also in the progress bar): the examples of this process since the previous log
    over the time since then. ``scripts/train.py`` adds one
    with ``log=False`` when the callbacks config has none, for the run record (``results.json``).

    Args:
        unit: name of one example in the metric (``images``, ``tokens``).
        count: how a batch's first tensor counts examples: ``"rows"`` (its dim 0: images) or ``"elements"`` (all
            its entries: the tokens of ``[batch, seq_len]`` ids; of an ``(inputs, targets, padding_mask)`` batch the
            real tokens only, counted on the device and read when logged or totalled: padding is not throughput).
        log: log the throughput (False: count only).

    Attributes (totals of this process's fit; they are saved in checkpoints, so a resumed run counts the batches
    and seconds before its checkpoint too):
        examples: examples of every training batch, times the world size (every rank trains on a shard of the
            same size; with padding, this rank's real tokens times the world size).
        batches: training batches.
        fit_seconds: wall time from the start to the end of fit (validation and checkpoints included; a resumed
            fit adds the time up to its checkpoint), None before the fit ends.
        timed_seconds, timed_examples, timed_batches: the clock's intervals and their examples and batches.
    """

    def __init__(self, unit: str = "images", count: str = "rows", log: bool = True) -> None:
        if count not in ("rows", "elements"):
            raise ValueError(f"ThroughputMonitor count={count!r}; allowed: 'rows', 'elements'")
        self.unit = unit
        self.count = count
        self.log = log
        self._examples: int | Tensor = 0  # a device tensor once a padding mask is counted
        self.batches = 0
        self.fit_seconds: float | None = None
        self.timed_seconds = 0.0
        self._timed_examples: int | Tensor = 0
        self.timed_batches = 0
        self._fit_start: float | None = None
        self._earlier_fit_seconds = 0.0  # of the fit a checkpoint resumed
        self._restored: dict[str, Any] | None = None  # the state of a checkpoint, until its fit starts training
        self._validation_start: float | None = None
        self._last_batch_end: float | None = None
        self._log_start: float | None = None
        self._log_examples = 0
        self._logged_step = 0  # the optimizer step last logged: once per step under gradient accumulation

    def batch_examples(self, batch) -> int | Tensor:
        """Examples in one batch of this process: its first tensor's rows or elements, or the ``True`` entries of a
        padding mask (the third tensor, bool, of the first one's shape) as a tensor on its device."""
        first = batch[0]
        if self.count == "rows":
            return int(first.shape[0])
        mask = batch[2] if isinstance(batch, (tuple, list)) and len(batch) > 2 else None
        if isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.shape == first.shape:
            return mask.sum()
        return int(first.numel())

    @property
    def examples(self) -> int:
        return int(self._examples)  # read from the device once the counts are tensors

    @property
    def timed_examples(self) -> int:
        return int(self._timed_examples)

    @property
    def mean_throughput(self) -> float | None:
        """Examples per second over the timed intervals; None when nothing was timed."""
        return self.timed_examples / self.timed_seconds if self.timed_seconds > 0 else None

    @property
    def mean_batch_seconds(self) -> float | None:
        """Mean seconds per training batch over the timed intervals; None when nothing was timed."""
        return self.timed_seconds / self.timed_batches if self.timed_batches else None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start, self.fit_seconds = time.perf_counter(), None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._fit_start is not None:
            self.fit_seconds = self._earlier_fit_seconds + time.perf_counter() - self._fit_start

    def state_dict(self) -> dict[str, Any]:
        """The totals so far (``fit_seconds``: up to now), for a resumed fit to go on from."""
        running = 0.0 if self._fit_start is None else time.perf_counter() - self._fit_start
        return {
            "examples": self.examples,
            "batches": self.batches,
            "fit_seconds": self.fit_seconds if self.fit_seconds is not None else self._earlier_fit_seconds + running,
            "timed_seconds": self.timed_seconds,
            "timed_examples": self.timed_examples,
            "timed_batches": self.timed_batches,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks from the checkpoint of a test or validation too (the best one, after a fit):
        # the totals go on from a checkpoint only when it resumes a fit, at the start of its training.
        self._restored = dict(state_dict)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state, self._restored = self._restored, None
        if state:
            self._examples, self.batches = int(state["examples"]), int(state["batches"])
            self._earlier_fit_seconds = float(state["fit_seconds"])
            self.timed_seconds = float(state["timed_seconds"])
            self._timed_examples, self.timed_batches = int(state["timed_examples"]), int(state["timed_batches"])

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last_batch_end is not None:  # a validation within a training epoch: stop the clock
            self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_start is not None and self._last_batch_end is not None:
            paused = time.perf_counter() - self._validation_start
            self._last_batch_end += paused
            self._log_start = None if self._log_start is None else self._log_start + paused
        self._validation_start = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_batch_end = self._log_start = None
        self._log_examples = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        examples = self.batch_examples(batch)
        self._examples = self._examples + examples * trainer.world_size
        self.batches += 1
        if self._last_batch_end is None:  # the epoch's first batch starts the clock
            self._last_batch_end = self._log_start = now
            return
        self.timed_seconds += now - self._last_batch_end
        self._timed_examples = self._timed_examples + examples * trainer.world_size
        self.timed_batches += 1
        self._last_batch_end = now
        self._log_examples = self._log_examples + examples
        step = trainer.global_step
        if self.log and step != self._logged_step and step % max(1, trainer.log_every_n_steps) == 0:
            self._logged_step = step
            elapsed = now - self._log_start
            if elapsed > 0:
                throughput = self._log_examples / elapsed
                pl_module.log(f"train/{self.unit}_per_sec", throughput, on_step=True, on_epoch=False, prog_bar=True)
            self._log_start, self._log_examples = now, 0
