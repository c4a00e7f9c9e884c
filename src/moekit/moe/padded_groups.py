"""Ragged expert groups run as equal ones: the dispatch copies each expert's token rows into a zero-padded block of a
buffer, the experts' products run as batched matmuls over it, and the combine reads each assignment's row back.

Under bf16 on a CPU with AMX, oneDNN's per-expert products of the loop kernel ran at about half the rate of one
batched matmul over the same rows (an expert's weight gradient, a product of a few outputs over thousands of rows,
splits poorly over the threads, where the batch splits by expert; docs/performance.md, "bf16 autocast on a CPU"). A
dispatch whose groups are nearly equal pays little padding for the batched kernel: a tokens-choice layer asks its
:class:`~moekit.moe.ExpertBank` (:meth:`~moekit.moe.ExpertBank.padding`) and, where the padding adds at most
``PADDED_GROUPS_MAX_PERCENT`` of :mod:`moekit.moe.kernel_choices` (by the CPU's matrix units; less for experts that
drop out, whose padding rows draw masks too) to the rows,
:func:`~moekit.moe.dispatch.dispatch` gathers the tokens straight into the buffer and
:func:`~moekit.moe.dispatch.combine` gathers the outputs straight from it: no copy of the rows in and out of the
buffer. The longest group sets the buffer's rows per expert, rounded up to one of 16 sizes per power of two: a bounded
set of shapes for oneDNN's kernel cache. Padding rows are zeros and their outputs are never read: their gradients are
zero and add nothing to the experts' weights.

Not taken under ``torch.compile`` (the buffer's size is read from the counts on the host), a ``TorchDispatchMode``
(the FLOP counter would count the padding) or expert parallelism (each rank's rows arrive after the exchange).
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
    """Where each of the ``rows`` kept assignments, in dispatch order (sorted by expert), lies in a buffer of
    ``rows_per_expert`` rows per expert: ``dest_R[r]``, row ``r``'s row of the buffer ``[experts * rows_per_expert,
    features]``; ``pad_rows``, the buffer's other rows."""

    dest_R: Tensor
    pad_rows: Tensor
    rows_per_expert: int
    num_experts: int

    @property
    def rows(self) -> int:
        return self.dest_R.shape[0]

    @property
    def buffer_rows(self) -> int:
        return self.num_experts * self.rows_per_expert

    def gather(self, x_ND: Tensor, tokens_R: Tensor) -> Tensor:
        """The buffer ``[buffer_rows, d]``: each dispatched row's token from ``x_ND`` (``tokens_R``: the token of each
        row in dispatch order, kept ones first), padding rows zero. One ``index_select`` of the buffer's rows (padding
        rows read token 0) and an ``index_fill_`` of the padding rows, outside autograd: their outputs are never read,
        so their gradients are zeros anyway, where autograd's ``index_fill_`` copies the whole gradient to zero them."""
        tokens_B = tokens_R.new_zeros(self.buffer_rows).index_copy_(0, self.dest_R, tokens_R[: self.rows])
        buffer = x_ND.index_select(0, tokens_B)
        with torch.no_grad():
            buffer.index_fill_(0, self.pad_rows, 0)
        return buffer

    def buffer_rows_of(self, rows_A: Tensor) -> Tensor:
        """The buffer row of each assignment, from ``rows_A``, its row in dispatch order; a dropped assignment (a row
        past the kept ones, its gate zeroed by the combine) reads buffer row 0."""
        dest = F.pad(self.dest_R, (0, rows_A.numel() - self.rows))
        return dest.index_select(0, rows_A)


def plan_padding(counts: Tensor, dtype: torch.dtype, kernel: str, dropout: bool = False) -> PaddedGroups | None:
    """The padding of ragged groups of ``counts`` rows (``[experts]``) whose products run in ``dtype``, or None where
    the experts run on the ragged rows: another kernel than ``"auto"``'s loop, a device other than the CPU, rows not in
    bf16, a CPU without an entry in ``PADDED_GROUPS_MAX_PERCENT`` (``PADDED_GROUPS_MAX_PERCENT_DROPOUT`` for experts
    that drop out, ``dropout``), more padding than the entry allows, ``torch.compile`` or a dispatch mode."""
    if kernel != "auto" or counts.device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if kernel_choices.AUTO_KERNELS.get(("cpu", "ragged"), "loop") != "loop":
        return None
    table = kernel_choices.PADDED_GROUPS_MAX_PERCENT_DROPOUT if dropout else kernel_choices.PADDED_GROUPS_MAX_PERCENT
    limit = table.get(kernel_choices.cpu_matrix_units())
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
    shift_E = torch.tensor([e * per_expert - start for e, start in enumerate(starts)], device=counts.device)
    dest_R = torch.arange(rows, device=counts.device) + shift_E.repeat_interleave(counts, output_size=rows)
    padding_B = torch.ones(num_experts * per_expert, dtype=torch.bool, device=counts.device).index_fill_(0, dest_R, 0)
    return PaddedGroups(dest_R, padding_B.nonzero().squeeze(1), per_expert, num_experts)
