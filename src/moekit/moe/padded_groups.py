"""Ragged expert groups run as equal ones: each expert's rows copied into a zero-padded buffer, the experts' products
as batched matmuls over it, the rows copied back.

Under bf16 on a CPU with AMX, oneDNN's per-expert products of the loop kernel ran at about half the rate of one
batched matmul over the same rows (an expert's weight gradient, a product of a few outputs over thousands of rows,
splits poorly over the threads, where the batch splits by expert; docs/performance.md, "bf16 autocast on a CPU"). A
dispatch whose groups are nearly equal pays little padding for the batched kernel: an
:class:`~moekit.moe.ExpertBank` pads its rows once before ``fc1`` and unpads once after ``fc2``, where the padding
adds at most ``PADDED_GROUPS_MAX_PERCENT`` of :mod:`moekit.moe.kernel_choices` (by the CPU's matrix units) to the
rows. The longest group sets the buffer's rows per expert, rounded up to one of 16 sizes per power of two: a bounded
set of shapes for oneDNN's kernel cache. Padded rows are zeros, so their gradients add nothing to the experts'
weights, and their outputs are dropped.

Not taken under ``torch.compile`` (the buffer's size is read from the counts on the host) or a ``TorchDispatchMode``
(the FLOP counter would count the padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernel_choices

__all__ = ["PaddedGroups", "padded_rows", "plan_padding"]


def padded_rows(longest: int) -> int:
    """``longest`` rounded up to one of 16 sizes per power of two (a multiple of 8 at least): 3392 -> 3456."""
    step = max(8, 1 << max(0, (longest - 1).bit_length() - 5))
    return -(-longest // step) * step


@dataclass(frozen=True)
class PaddedGroups:
    """Where each of the ``rows`` dispatched rows (sorted by expert) lies in a buffer of ``rows_per_expert`` rows per
    expert: ``dest_R[r]``, row ``r``'s row of the buffer ``[experts * rows_per_expert, features]``."""

    dest_R: Tensor
    rows_per_expert: int
    num_experts: int

    @property
    def rows(self) -> int:
        return self.dest_R.shape[0]

    def pad(self, x: Tensor) -> Tensor:
        """``[rows (+ a tail), in]`` -> ``[experts * rows_per_expert, in]``: each expert's rows, then zeros."""
        buffer = x.new_zeros(self.num_experts * self.rows_per_expert, x.shape[-1])
        return buffer.index_copy(0, self.dest_R, x[: self.rows])

    def unpad(self, y: Tensor, total_rows: int) -> Tensor:
        """The buffer's real rows, back in dispatch order: ``[total_rows, out]``, rows past ``rows`` (the tail of
        dropped assignments) zeros."""
        y = y.index_select(0, self.dest_R)
        return F.pad(y, (0, 0, 0, total_rows - self.rows)) if total_rows > self.rows else y


def plan_padding(x: Tensor, counts: Tensor, kernel: str) -> PaddedGroups | None:
    """The padding of ragged groups of ``counts`` rows (``[experts]``) of ``x``, or None where the experts run on
    the ragged rows: another kernel than ``"auto"``'s loop, a device other than the CPU, rows not in bf16, a CPU
    without an entry in ``PADDED_GROUPS_MAX_PERCENT``, more padding than the entry allows, ``torch.compile`` or a
    dispatch mode."""
    if kernel != "auto" or x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return None
    if kernel_choices.AUTO_KERNELS.get(("cpu", "ragged"), "loop") != "loop":
        return None
    limit = kernel_choices.PADDED_GROUPS_MAX_PERCENT.get(kernel_choices.cpu_matrix_units())
    if limit is None or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return None
    sizes = counts.tolist()  # the host read the loop makes too (free on a CPU)
    rows, num_experts = sum(sizes), len(sizes)
    if not rows:
        return None
    per_expert = padded_rows(max(sizes))
    if num_experts * per_expert * 100 > rows * (100 + limit):
        return None
    starts = accumulate(sizes[:-1], initial=0)  # each expert's first row in dispatch order
    shift_E = torch.tensor([e * per_expert - start for e, start in enumerate(starts)], device=x.device)
    dest_R = torch.arange(rows, device=x.device) + shift_E.repeat_interleave(counts, output_size=rows)  # buffer rows
    return PaddedGroups(dest_R, per_expert, num_experts)
