"""Token dispatch for tokens-choice routing: expert capacity, Batch Prioritized Routing, and the
permutation of token copies into expert-sorted rows and back.

Each of ``N`` tokens chose ``k`` experts: ``expert_ids [N, k]``. Assignment ``a = n * k + j`` is the
``j``-th choice of token ``n``. :func:`plan_dispatch` decides which assignments an expert keeps when
its capacity ``C`` (:func:`moekit.moe.capacity.tokens_choice_capacity`) is exceeded and orders the kept
ones by expert; :func:`dispatch` gathers their token rows; :func:`combine` puts expert outputs back and
sums each token's gated copies.

Padding (``valid`` False) takes no capacity and reaches no expert: its assignments are dropped before any queue
is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import kernel_choices
from .experts import compute_dtype
from .padded_groups import PaddedGroups
from .routing import count_ids

__all__ = ["DispatchPlan", "priority_order", "plan_dispatch", "dispatch", "kept_rows", "combine", "apply_experts"]

# torch's CPU sort runs a 1-D integer tensor of at least this many entries (at::internal::GRAIN_SIZE) as a parallel
# radix sort, stable and linear in its length; shorter ones, and floats, get a comparison sort. From
# kernel_choices.SORT_RADIX_FROM keys on, expert ids and priorities sort as int32 keys padded to this length.
_CPU_RADIX_MIN = 32768
_INT32_MAX = 2**31 - 1


@dataclass
class DispatchPlan:
    """Where every assignment goes.

    Attributes:
        order: ``[N * k]`` assignment ids sorted by expert, kept ones first, dropped ones last.
        counts: ``[E]`` kept assignments per expert (``<= capacity``).
        keep: ``[N, k]`` bool, False where capacity dropped the assignment.
        top_k: ``k``.
        all_kept: True when nothing can be dropped (dropless, no padding, no router mask): the groups of
            ``counts`` then cover all ``N * k`` dispatched rows, and the experts need not zero a tail.
        inverse: ``[N * k]`` the row of each assignment in ``order`` (``order``'s inverse permutation).
    """

    order: Tensor
    counts: Tensor
    keep: Tensor
    top_k: int
    all_kept: bool = False
    inverse: Tensor = field(init=False)

    def __post_init__(self) -> None:
        rows = torch.arange(self.order.numel(), device=self.order.device)
        self.inverse = torch.empty_like(self.order).scatter_(0, self.order, rows)


class _GatherRows(torch.autograd.Function):
    """``src.index_select(0, index)`` whose gradient gathers too: ``index`` takes every row of ``src`` exactly
    ``copies`` times (but the rows ``zero_rows``, whose gradient is zero), so row ``i`` of the gradient sums the
    ``copies`` rows ``back[i * copies : (i + 1) * copies]`` of the output's gradient. ``index_select``'s own backward
    scatters with ``index_add_``: atomic adds on a GPU (15% of a 256-expert top-2 layer's GPU time on an H200, and a
    different summation order from run to run), into zeros on a CPU.

    On a 2-core AMD EPYC (float32, 4096-16384 tokens of width 512, forward + backward) this took 0.83-0.91x the time of
    ``index_select`` for the combine's permutation (``copies`` 1), but 1.6x for the dispatch's copies (``copies`` 2-8:
    the gathered gradient is a pass more than CPU ``index_add_``'s), so the CPU dispatch keeps ``index_select``
    (``DISPATCH_GRADIENT`` of :mod:`moekit.moe.kernel_choices`)."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, back: Tensor, copies: int, zero_rows: Tensor | None = None) -> Tensor:
        ctx.save_for_backward(back, zero_rows)
        ctx.copies = copies
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        back, zero_rows = ctx.saved_tensors
        grad = grad_out.index_select(0, back)
        if ctx.copies > 1:
            grad = grad.view(-1, ctx.copies, grad.shape[-1]).sum(dim=1)
        if zero_rows is not None:
            grad.index_fill_(0, zero_rows, 0)
        return grad, None, None, None, None


def _stable_sort(keys: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """``torch.sort(keys, stable=True)`` of 1-D integer ``keys`` below ``bound``; on a CPU from
    ``kernel_choices.SORT_RADIX_FROM`` keys on, as int32 keys (``bound`` at most ``2**31``) padded to torch's radix
    sort (the values then int32)."""
    num = keys.numel()
    radix = keys.device.type == "cpu" and num >= kernel_choices.SORT_RADIX_FROM and bound <= 2**31
    if not radix or torch.compiler.is_compiling():
        return torch.sort(keys, stable=True)
    keys = keys.int()
    if num < _CPU_RADIX_MIN:  # the padding sorts last, after every key
        keys = torch.cat([keys, keys.new_full((_CPU_RADIX_MIN - num,), _INT32_MAX)])
    values, indices = torch.sort(keys, stable=True)
    return values[:num], indices[:num]


def priority_order(priority: Tensor) -> Tensor:
    """Batch Prioritized Routing (Riquelme et al. 2021): the order in which tokens claim expert capacity,
    highest ``priority`` (the top router score) first, ties by index. ``[N] -> [N]`` token indices."""
    radix = (
        priority.dtype == torch.float32
        and priority.device.type == "cpu"
        and priority.numel() >= kernel_choices.SORT_RADIX_FROM
    )
    if not radix or torch.compiler.is_compiling():
        return torch.sort(priority, descending=True, stable=True).indices
    # float32 as int32 in the same order (a negative float's magnitude bits flipped; -0.0 made +0.0 and every NaN one
    # positive NaN first, which orders above +inf as torch's sort does), then bitwise not: ascending int keys in
    # descending float order, for the radix sort of _stable_sort
    bits = torch.where(priority.isnan(), float("nan"), priority + 0.0).view(torch.int32)
    return _stable_sort(~(bits ^ ((bits >> 31) & _INT32_MAX)), 2**31)[1]


def _keep_within_capacity(
    expert_ids: Tensor,
    num_experts: int,
    capacity: int | Tensor,
    priority: Tensor | None,
    group_ids: Tensor | None,
    num_groups: int,
    token_major: bool = False,
    earlier_counts: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """``[N, k]`` bool: an assignment is kept if fewer than ``capacity`` assignments come before it in
    its queue. There is one queue per expert (per ``(group, expert)`` pair when ``group_ids`` is given).
    A queue holds all first choices, then all second choices, ... (``token_major``: each token's choices, then
    the next token's); tokens come in ``priority`` order (highest first; Batch Prioritized Routing) or in index
    order (first come, first served). ``earlier_counts: [num_groups * E]`` assignments queued before this call.
    ``capacity``: an int, a scalar tensor, or ``[num_groups]`` (each group's). ``valid: [N]``: the other tokens
    queue apart, in one extra queue that keeps nothing."""
    num_tokens, top_k = expert_ids.shape
    per_expert = num_experts
    if group_ids is not None:
        expert_ids = expert_ids + (group_ids * num_experts).unsqueeze(1)  # queue id = group * E + expert
        num_experts = num_groups * num_experts
    num_queues = num_experts
    if valid is not None:
        expert_ids = torch.where(valid.unsqueeze(1), expert_ids, num_queues)
        num_experts = num_queues + 1
    if priority is None:
        token_order = torch.arange(num_tokens, device=expert_ids.device)
    else:
        token_order = priority_order(priority)
    ordered = expert_ids.index_select(0, token_order)  # [N, k] in token_order
    queue = (ordered if token_major else ordered.t()).reshape(-1)
    sorted_experts, perm = _stable_sort(queue, num_experts)
    counts = count_ids(queue, num_experts)
    starts = counts.cumsum(0) - counts
    position_sorted = torch.arange(queue.numel(), device=queue.device) - starts.index_select(0, sorted_experts)
    position = torch.empty_like(position_sorted).scatter_(0, perm, position_sorted)
    if earlier_counts is not None:
        position = position + torch.cat([earlier_counts, earlier_counts.new_zeros(num_experts - num_queues)])[queue]
    if isinstance(capacity, Tensor) and capacity.dim() == 1:  # each group's capacity
        capacity = torch.cat([capacity, capacity.new_zeros(1)])[torch.div(queue, per_expert, rounding_mode="floor")]
    keep_queue = (position < capacity) & (queue < num_queues)
    keep_queue = keep_queue.view(num_tokens, top_k) if token_major else keep_queue.view(top_k, num_tokens).t()
    return torch.empty_like(keep_queue).index_copy_(0, token_order, keep_queue)


def plan_dispatch(
    expert_ids: Tensor,
    num_experts: int,
    capacity: int | None = None,
    priority: Tensor | None = None,
    group_ids: Tensor | None = None,
    num_groups: int = 1,
    keep: Tensor | None = None,
    token_major: bool = False,
    earlier_counts: Tensor | None = None,
    valid: Tensor | None = None,
) -> DispatchPlan:
    """Plan the dispatch of ``expert_ids: [N, k]``.

    Args:
        expert_ids: ``[N, k]`` chosen experts per token.
        num_experts: ``E``.
        capacity: assignments per expert (see :func:`~moekit.moe.capacity.tokens_choice_capacity`), or None
            for dropless; a tensor when counted on device (a scalar, or ``[num_groups]``: each group's own).
        priority: ``[N]`` token priority for Batch Prioritized Routing (higher is served first), or
            None to serve tokens in index order. Ignored when ``capacity`` is None.
        group_ids: ``[N]`` long in ``[0, num_groups)``: apply ``capacity`` to each group of tokens
            separately (each expert takes up to ``capacity`` assignments from every group). Grouping the
            tokens by sequence position makes dropping causal: a token competes only with the tokens at
            its own position.
        num_groups: the number of groups ``group_ids`` uses.
        keep: ``[N, k]`` bool, the assignments the router made (a router with a variable number of experts per
            token passes ``k = E`` candidates and marks the real ones); only with ``capacity`` None.
        token_major: queue each token's choices before the next token's (then a token's drops depend on earlier
            tokens only), instead of all first choices before all second choices (GShard, V-MoE).
        earlier_counts: ``[num_groups, E]`` assignments each group sent to each expert before this call (a
            decoding cache's), counted against the capacity first.
        valid: ``[N]`` bool, False for padding: its assignments are dropped and take no capacity.
    """
    all_kept = capacity is None and keep is None and valid is None  # dropless, no padding: nothing sorts last
    if capacity is None:
        if keep is None:
            keep = torch.ones_like(expert_ids, dtype=torch.bool)
        if valid is not None:
            keep = keep & valid.unsqueeze(1)
    elif keep is not None:
        raise ValueError("plan_dispatch: pass either keep (a router's own mask) or a capacity, not both")
    else:
        earlier = earlier_counts.reshape(-1) if earlier_counts is not None else None
        keep = _keep_within_capacity(
            expert_ids, num_experts, capacity, priority, group_ids, num_groups, token_major, earlier, valid
        )
    key = expert_ids.reshape(-1) if all_kept else torch.where(keep, expert_ids, num_experts).reshape(-1)
    order = _stable_sort(key, num_experts + 1)[1]
    counts = count_ids(key, num_experts + 1)[:num_experts]
    return DispatchPlan(order=order, counts=counts, keep=keep, top_k=expert_ids.shape[1], all_kept=all_kept)


def dispatch(x: Tensor, plan: DispatchPlan, padding: PaddedGroups | None = None, kept: int | None = None) -> Tensor:
    """``x: [N, d]`` -> ``[N * k, d]`` token copies in ``plan.order`` (expert-sorted rows), or with ``padding`` the
    buffer of equal groups it describes (:mod:`moekit.moe.padded_groups`), or with ``kept`` the first ``kept`` rows
    only (:func:`kept_rows`)."""
    order = plan.order if kept is None else plan.order[:kept]
    tokens = torch.div(order, plan.top_k, rounding_mode="floor")  # [N * k] (or [kept]): the token of each row
    if kept is not None:
        return x.index_select(0, tokens)
    if padding is not None:
        return padding.gather(x, tokens)
    if kernel_choices.DISPATCH_GRADIENT.get(x.device.type, "gather") == "index_add":
        return x.index_select(0, tokens)
    return _GatherRows.apply(x, tokens, plan.inverse, plan.top_k)


def kept_rows(plan: DispatchPlan) -> int | None:
    """How many assignments ``plan`` kept, where the experts can leave out the dropped ones' rows, else None. A
    dropped row comes out of the experts as zeros and its gate is zero, but costs what a kept one costs outside the
    products (the activation, dropout, casts, the gathers). For experts that read their counts on the host anyway
    (the CPU loop: :meth:`~moekit.moe.ExpertBank.reads_counts_on_host`), in eager mode, where the dispatch's gradient
    is ``index_select``'s own (``DISPATCH_GRADIENT``; the gather's takes every token's ``k`` copies)."""
    if plan.all_kept or torch.compiler.is_compiling():
        return None
    if kernel_choices.DISPATCH_GRADIENT.get(plan.order.device.type, "gather") != "index_add":
        return None
    kept = int(plan.counts.sum())
    return kept if 0 < kept < plan.order.numel() else None


def apply_experts(experts: nn.Module, x_ND: Tensor, plan: DispatchPlan, gates: Tensor) -> Tensor:
    """``[N, o]``: each token of ``x_ND`` through the experts ``plan`` chose, weighted by ``gates``: :func:`dispatch`,
    the bank (an :class:`~moekit.moe.ExpertBank`) and :func:`combine`, over zero-padded groups (equal, or each a whole
    number of row blocks) where the bank's :meth:`~moekit.moe.ExpertBank.padding` says so, else over the kept rows
    alone where :func:`kept_rows` says so.

    The tokens are cast to the experts' compute dtype (autocast's) before the dispatch copies them: under bf16 autocast
    the ``k`` copies move half the bytes of float32 ones, and the gradient of a token's copies is summed in bf16, as the
    combine sums its expert outputs (docs/performance.md, "The dispatch in the compute dtype")."""
    x_ND = x_ND.to(compute_dtype(x_ND))
    padding = experts.padding(plan.counts, x_ND)
    kept = kept_rows(plan) if padding is None and experts.reads_counts_on_host(x_ND) else None
    groups = plan.counts if padding is None else padding.group_sizes
    expert_out = experts(dispatch(x_ND, plan, padding, kept), groups, no_tail=plan.all_kept or kept is not None)
    return combine(expert_out, plan, gates, padding, kept)


def combine(
    expert_out: Tensor,
    plan: DispatchPlan,
    gates: Tensor,
    padding: PaddedGroups | None = None,
    kept: int | None = None,
) -> Tensor:
    """Weighted sum of each token's expert outputs.

    Args:
        expert_out: ``[N * k, o]`` in ``plan.order`` (rows of dropped assignments are ignored), its first ``kept``
            rows, or the buffer of ``padding``.
        plan: the plan used for :func:`dispatch`.
        gates: ``[N, k]`` gate values.
        padding, kept: what was given to :func:`dispatch`, if anything.

    Returns:
        ``[N, o]``: ``sum_j keep[n, j] * gates[n, j] * expert_out[n, j]``; a token whose assignments
        were all dropped gets zeros (the block's residual then carries it through unchanged).
    """
    num_tokens, top_k = gates.shape
    if padding is not None:  # a dropped assignment reads buffer row 0 (its zero gate sends it no gradient)
        rows_A = padding.buffer_rows_of(plan.inverse)
        per_assignment = _GatherRows.apply(expert_out, rows_A, padding.assignments_of(plan.order), 1, padding.pad_rows)
    elif kept is not None:  # a dropped assignment reads the last kept row; its zero gate sends it no gradient
        per_assignment = _GatherRows.apply(expert_out, plan.inverse.clamp(max=kept - 1), plan.order[:kept], 1)
    else:
        per_assignment = _GatherRows.apply(expert_out, plan.inverse, plan.order, 1)
    per_assignment = per_assignment.view(num_tokens, top_k, -1)
    weights = torch.where(plan.keep, gates, 0.0).to(per_assignment.dtype)
    if top_k == 1:
        return per_assignment[:, 0] * weights
    device = per_assignment.device.type
    min_macs = kernel_choices.COMBINE_BMM_MIN_MACS.get(device)
    on_blas = min_macs is not None and per_assignment.dtype in (torch.float32, torch.float64)
    large = on_blas and top_k * per_assignment.shape[-1] >= min_macs
    counted = not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() > 0
    if large or counted:
        # [1, k] @ [k, o] per token as one batched matmul. Also under a TorchDispatchMode (the FLOP counter's), so
        # that the combine's 2 k o FLOPs per token count whichever path runs.
        return torch.bmm(weights.unsqueeze(1), per_assignment).squeeze(1)
    if top_k == 2 and device in kernel_choices.COMBINE_PAIR_DEVICES and not torch.compiler.is_compiling():
        return _CombinePair.apply(per_assignment, weights)
    return (per_assignment * weights.unsqueeze(-1)).sum(dim=1)


class _CombinePair(torch.autograd.Function):
    """``y = w0 * a0 + w1 * a1`` per token, the top-2 combine of ``a: [N, 2, o]`` and ``w: [N, 2]``: one product and
    one fused multiply-add, without the ``[N, 2, o]`` product that a multiply and a sum over the middle dim write and
    read again (where it runs, and what it saves: ``COMBINE_PAIR_DEVICES`` of :mod:`moekit.moe.kernel_choices`)."""

    @staticmethod
    def forward(ctx, a_N2O: Tensor, w_N2: Tensor) -> Tensor:
        ctx.save_for_backward(a_N2O, w_N2)
        return (a_N2O[:, 0] * w_N2[:, :1]).addcmul_(a_N2O[:, 1], w_N2[:, 1:])

    @staticmethod
    def backward(ctx, grad_NO: Tensor):
        a_N2O, w_N2 = ctx.saved_tensors
        grad_a = None
        if ctx.needs_input_grad[0]:  # laid out as a: the gates of a choice-major plan are column-major [N, 2]
            grad_a = torch.mul(grad_NO.unsqueeze(1), w_N2.unsqueeze(-1), out=torch.empty_like(a_N2O))
        grad_w = (a_N2O * grad_NO.unsqueeze(1)).sum(dim=-1) if ctx.needs_input_grad[1] else None
        return grad_a, grad_w
