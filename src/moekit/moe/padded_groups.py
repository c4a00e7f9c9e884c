"""Ragged expert groups run zero-padded: the dispatch copies each expert's token rows into a zero-padded block of a
buffer, the experts' products run over it (as batched matmuls where the blocks are equal), and the combine reads each
assignment's row back.

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

Where equal groups would pad too much, each group is padded up to a multiple of ``ROW_BLOCK`` instead, ragged still,
where that adds at most ``BLOCK_PADDING_MAX_PERCENT`` to the rows: the loop then runs one product per expert on a row
count of the bounded set, where it ran the bulk of the rows and the rest as two (oneDNN copies the weight at every
call, so the rest cost about what a product of the bulk's rows costs; docs/performance.md, "New row counts and
oneDNN's kernels").

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
    """Where each of the ``rows`` kept assignments, in dispatch order (sorted by expert), lies in a buffer whose
    expert groups hold ``group_sizes`` rows (an int: equal groups; a ``[experts]`` tensor: ragged ones): ``dest_R[r]``,
    row ``r``'s row of the buffer ``[buffer_rows, features]``; ``pad_rows``, the buffer's other rows."""

    dest_R: Tensor
    pad_rows: Tensor
    group_sizes: int | Tensor
    buffer_rows: int

    @property
    def rows(self) -> int:
        return self.dest_R.shape[0]

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

    def assignments_of(self, order: Tensor) -> Tensor:
        """The assignment whose output each buffer row holds, from ``order``, the assignment of each row in dispatch
        order (kept ones first); padding rows: 0 (their outputs are read by no assignment)."""
        return order.new_zeros(self.buffer_rows).index_copy_(0, self.dest_R, order[: self.rows])

    def buffer_rows_of(self, rows_A: Tensor) -> Tensor:
        """The buffer row of each assignment, from ``rows_A``, its row in dispatch order; a dropped assignment (a row
        past the kept ones, its gate zeroed by the combine) reads buffer row 0."""
        dest = F.pad(self.dest_R, (0, rows_A.numel() - self.rows))
        return dest.index_select(0, rows_A)


def plan_padding(counts: Tensor, dtype: torch.dtype, kernel: str, dropout: bool = False) -> PaddedGroups | None:
    """The padding of ragged groups of ``counts`` rows (``[experts]``) whose products run in ``dtype``, or None where
    the experts run on the ragged rows: another kernel than ``"auto"``'s loop, a device other than the CPU, rows not in
    bf16, ``torch.compile`` or a dispatch mode, or a CPU whose matrix units have no entry that takes these counts: equal
    groups where ``PADDED_GROUPS_MAX_PERCENT`` (``PADDED_GROUPS_MAX_PERCENT_DROPOUT`` for experts that drop out,
    ``dropout``) allows their padding, else groups rounded up to ``ROW_BLOCK`` rows where ``BLOCK_PADDING_MAX_PERCENT``
    allows theirs."""
    if kernel != "auto" or counts.device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if kernel_choices.AUTO_KERNELS.get(("cpu", "ragged"), "loop") != "loop":
        return None
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return None
    units = kernel_choices.cpu_matrix_units()
    table = kernel_choices.PADDED_GROUPS_MAX_PERCENT_DROPOUT if dropout else kernel_choices.PADDED_GROUPS_MAX_PERCENT
    limit, block_limit = table.get(units), kernel_choices.BLOCK_PADDING_MAX_PERCENT.get(units)
    if limit is None and block_limit is None:
        return None
    sizes = counts.tolist()  # the host read the loop makes too (free on a CPU)
    rows, num_experts = sum(sizes), len(sizes)
    if not rows:
        return None
    per_expert = padded_rows(max(sizes))
    if limit is not None and num_experts * per_expert * 100 <= rows * (100 + limit):
        return _pad(counts, sizes, [per_expert] * num_experts, per_expert)
    block = kernel_choices.ROW_BLOCK
    padded = [-(-size // block) * block for size in sizes]
    if block_limit is None or sum(padded) * 100 > rows * (100 + block_limit) or padded == sizes:
        return None
    return _pad(counts, sizes, padded, torch.tensor(padded, device=counts.device))


def _pad(counts: Tensor, sizes: list[int], padded: list[int], group_sizes: int | Tensor) -> PaddedGroups:
    """The buffer of groups of ``padded`` rows holding groups of ``sizes`` (``counts``) rows, each at its start."""
    rows = sum(sizes)
    starts = accumulate(sizes[:-1], initial=0)  # each expert's first row in dispatch order, and in the buffer
    buffer_starts = accumulate(padded[:-1], initial=0)
    shift_E = torch.tensor([b - s for b, s in zip(buffer_starts, starts, strict=True)], device=counts.device)
    dest_R = torch.arange(rows, device=counts.device) + shift_E.repeat_interleave(counts, output_size=rows)
    buffer_rows = sum(padded)
    padding_B = torch.ones(buffer_rows, dtype=torch.bool, device=counts.device).index_fill_(0, dest_R, 0)
    return PaddedGroups(dest_R, padding_B.nonzero().squeeze(1), group_sizes, buffer_rows)
