"""Token exchange for expert parallelism: the experts of a layer are split over the ranks of a
process group, and every rank sends each expert's rows to the rank that holds it.

With ``W`` ranks and ``E`` experts, rank ``r`` holds the ``L = E / W`` experts ``r * L ... (r + 1) * L - 1``.
A rank's expert input is sorted by expert (the :class:`~moekit.moe.ExpertBank` layout), so the rows
bound for rank ``r`` are one contiguous block. :func:`expert_parallel_apply`

1. exchanges the row counts per expert (``all_to_all_single`` of ``E`` integers), then reads both
   count tables on the host once (``all_to_all_single`` needs the split sizes as Python ints);
2. exchanges the rows (``all_to_all_single``): rank ``r`` receives, from every source rank, that
   rank's rows of its ``L`` experts (source-major);
3. regroups the received rows expert-major, runs the local experts, restores the source-major order;
4. sends the outputs back with the splits swapped.

Backward runs the same two exchanges with the splits swapped (:class:`AllToAll`). Bytes moved per
layer and rank: ``2 * rows_sent * dim * element_size`` forward (dispatch + return) and the same
again backward, of which the ``(W - 1) / W`` share bound for other ranks crosses the network.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AllToAll", "all_to_all", "expert_parallel_apply"]

GroupSizes = int | Tensor


class AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` of rows: ``x: [sum(input_splits), ...]`` ->
    ``[sum(output_splits), ...]``; the gradient travels back with the splits swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        output_splits, input_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(input_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group=None) -> Tensor:
    """See :class:`AllToAll`."""
    return AllToAll.apply(x, output_splits, input_splits, group)


def _source_to_expert_major(recv_counts: Tensor, total: int) -> Tensor:
    """``[total]`` long: the expert-major position of each received row.

    ``recv_counts: [W, L]`` rows received from source rank ``s`` for local expert ``e``. Received rows
    come in blocks ``(s, e)`` ordered source-major; expert-major order is blocks ``(e, s)``.
    """
    world, local = recv_counts.shape
    block_counts = recv_counts.reshape(-1)  # source-major blocks
    block_start = block_counts.cumsum(0) - block_counts
    expert_major_counts = recv_counts.t().reshape(-1)
    expert_major_start = (expert_major_counts.cumsum(0) - expert_major_counts).view(local, world).t().reshape(-1)
    block_of_row = torch.repeat_interleave(
        torch.arange(world * local, device=recv_counts.device), block_counts, output_size=total
    )
    row = torch.arange(total, device=recv_counts.device)
    return expert_major_start.index_select(0, block_of_row) + row - block_start.index_select(0, block_of_row)


def expert_parallel_apply(
    compute: Callable[[Tensor, GroupSizes], Tensor],
    x: Tensor,
    group_sizes: GroupSizes,
    num_experts: int,
    group,
) -> Tensor:
    """Run ``num_experts`` experts sharded over ``group`` on this rank's rows.

    Args:
        compute: the local experts, ``(rows [n, in] sorted by local expert, int | LongTensor [L]) -> [n, out]``.
        x: ``[rows, in]`` sorted by global expert (the :class:`~moekit.moe.ExpertBank` input layout).
        group_sizes: ``int`` rows per expert or ``LongTensor [E]`` counts; rows after the counted ones
            (dropped assignments) are not sent and come out as zeros.
        num_experts: ``E``, a multiple of the group size.
        group: the expert-parallel process group.

    Returns:
        ``[rows, out]``, what the unsharded experts would give.
    """
    world = dist.get_world_size(group)
    local = num_experts // world
    if isinstance(group_sizes, int):
        counts = torch.full((num_experts,), group_sizes, dtype=torch.long, device=x.device)
    else:
        counts = group_sizes.to(torch.long)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(world, local)
    # The one host read: rows to send to each rank, and the received count table.
    send_per_rank = counts.view(world, local).sum(1)
    host = torch.cat([send_per_rank, recv_counts.reshape(-1)]).tolist()
    send_splits, recv_table = host[:world], host[world:]
    recv_splits = [sum(recv_table[s * local : (s + 1) * local]) for s in range(world)]
    rows, received_rows = sum(send_splits), sum(recv_splits)

    received = all_to_all(x[:rows], recv_splits, send_splits, group)  # source-major
    destination = _source_to_expert_major(recv_counts, received_rows)
    source = torch.empty_like(destination).scatter_(0, destination, torch.arange(received_rows, device=x.device))
    expert_in = received.index_select(0, source)
    per_expert = [sum(recv_table[s * local + e] for s in range(world)) for e in range(local)]
    sizes: GroupSizes = (
        per_expert[0] if isinstance(group_sizes, int) and len(set(per_expert)) == 1 else recv_counts.sum(0)
    )
    expert_out = compute(expert_in, sizes)
    out = all_to_all(expert_out.index_select(0, destination), send_splits, recv_splits, group)
    if rows < x.shape[0]:
        out = torch.cat([out, out.new_zeros(x.shape[0] - rows, out.shape[1])])
    return out
