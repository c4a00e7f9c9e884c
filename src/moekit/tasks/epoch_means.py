"""Training-epoch means that a resumed run continues: the ``train/*_epoch`` losses and the training accuracy.

Lightning keeps the running sums of ``self.log(..., on_epoch=True)`` out of its checkpoints, so a run resumed in
the middle of an epoch would average only the batches trained since the resume. :class:`EpochMeans` holds the
sums itself, on the device (no host sync per step), and the task stores them in every checkpoint: the epoch
means of a resumed run equal the uninterrupted run's. The sums belong to one epoch; the first update of another
epoch starts them afresh, so a checkpoint written at an epoch's end (holding that whole epoch) resumes cleanly.

Under data parallelism each rank sums its own batches. :meth:`EpochMeans.reduced` adds the sums of all ranks
(one all-reduce): the epoch mean is the sum of every rank's weighted values over the sum of every rank's weights,
whatever each rank's weights (a language model weighs a batch by its real target tokens; a last batch may be
short on some ranks). Checkpoints hold these global sums; on resume one rank takes them and the others start
from zero, so the next reduction counts the batches before the resume once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
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

    def reduced(self, all_reduce: Callable[[Tensor], Tensor], device: torch.device) -> EpochMeans:
        """A copy holding the sums over all ranks: ``all_reduce`` sums a float64 tensor on ``device`` over the
        ranks (the process group's device: CUDA for NCCL, the CPU for gloo). Every rank must call it, with the
        same names (every rank logs the same ones)."""
        out = EpochMeans()
        out.epoch = self.epoch
        names = sorted(self.sums)
        if not names:  # no collective: every rank is in the same state
            return out
        flat = [torch.as_tensor(part, dtype=torch.float64, device=device) for name in names for part in self.sums[name]]
        summed = all_reduce(torch.stack(flat))  # float64: the weights stay whole numbers far past float32's 2**24
        for i, name in enumerate(names):
            out.sums[name] = (summed[2 * i].float(), summed[2 * i + 1].round().long())
        return out

    def state_dict(self) -> dict[str, Any]:
        cpu = {
            name: (total.cpu(), count.cpu() if isinstance(count, Tensor) else count)
            for name, (total, count) in self.sums.items()
        }
        return {"epoch": self.epoch, "sums": cpu}

    def load_state_dict(self, state: dict[str, Any], keep: bool = True) -> None:
        """Restore :meth:`state_dict`'s sums (0-dim CPU tensors, which add to a value on any device). With
        ``keep=False`` (data-parallel ranks other than the first, the saved sums being those of all ranks) the
        same names start from zero."""
        self.epoch = state["epoch"]
        self.sums = dict(state["sums"]) if keep else {name: (torch.zeros(()), 0) for name in state["sums"]}
