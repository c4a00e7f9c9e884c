"""Training-epoch means that a resumed run continues: the ``train/*_epoch`` losses and the training accuracy.

Lightning keeps the running sums of ``self.log(..., on_epoch=True)`` out of its checkpoints, so a run resumed in
the middle of an epoch would average only the batches trained since the resume. :class:`EpochMeans` holds the
sums itself, on the device (no host sync per step), and the task stores them in every checkpoint: the epoch
means of a resumed run equal the uninterrupted run's. The sums belong to one epoch; the first update of another
epoch starts them afresh, so a checkpoint written at an epoch's end (holding that whole epoch) resumes cleanly.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["EpochMeans"]


class EpochMeans:
    """Batch-size-weighted means of named scalars over the current training epoch."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.sums: dict[str, tuple[Tensor, int | Tensor]] = {}  # name -> (sum of value * weight, sum of weights)

    def update(self, name: str, value: Tensor, weight: int | Tensor, epoch: int) -> None:
        """Add ``value`` (a scalar tensor) with ``weight`` (the batch size, or a count on the device: a language
        model's real target tokens) to ``name``'s mean of ``epoch``."""
        if epoch != self.epoch:
            self.epoch, self.sums = epoch, {}
        total, count = self.sums.get(name, (0.0, 0))
        self.sums[name] = (value.detach().float() * weight + total, count + weight)

    def compute(self) -> dict[str, Tensor]:
        """``{name: mean}`` over the updates of the current epoch."""
        return {name: total / count for name, (total, count) in self.sums.items()}

    def state_dict(self) -> dict[str, Any]:
        cpu = {
            name: (total.cpu(), count.cpu() if isinstance(count, Tensor) else count)
            for name, (total, count) in self.sums.items()
        }
        return {"epoch": self.epoch, "sums": cpu}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s sums (0-dim CPU tensors, which add to a value on any device)."""
        self.epoch = state["epoch"]
        self.sums = dict(state["sums"])
