"""Balanced token-to-expert assignment for BASE layers (Lewis et al. 2021).

Problem: given affinities ``scores [N, E]`` and capacities ``c_e`` with ``sum c_e = N``, find
``a: tokens -> experts`` maximising ``sum_n scores[n, a(n)]`` with exactly ``c_e`` tokens per expert
(a transportation problem; its dual has one price per expert).

Two solvers share stage 1 (:func:`balanced_assignment`'s ``solver=``; :func:`resolve_solver` picks per device):

1. *Price auction* (bulk). Every token takes its best expert at the current prices,
   ``argmax_e scores[n, e] - price[e]``. Each over-subscribed expert raises its price to the
   market-clearing level: halfway between the ``c_e``-th and ``(c_e + 1)``-th largest margins of its
   claimants (a token's margin is its preference for this expert over its second best), so that
   only ``c_e`` of them still prefer it. A few rounds remove almost all excess.
2. ``"exact"``: *successive shortest paths*. While an expert is over capacity, move one token along the
   cheapest chain of moves from an over-full to an under-full expert: a Bellman-Ford search on the
   ``E x E`` graph whose edge ``e -> e'`` costs the smallest score loss of moving a token of ``e`` to
   ``e'``. Because every token held its best expert at the end of stage 1, this is the classical
   successive-shortest-path algorithm for min-cost flow and ends at the optimum. Its loops stop on
   conditions read on the host: it synchronises with the device, which costs nothing on a CPU. Under
   ``torch.compile`` it is one custom operator, opaque to it, so its host reads break no graph.

   ``"sync_free"``: a fixed number of rounds of everything, decided on the device (for accelerators, where
   every host read stalls the launch queue). Stage 1 runs all its rounds. Each expert keeps the ``c_e`` of its
   claimants that prefer it most; in each of ``fill_rounds`` rounds every token left over proposes to its best
   expert with room, which accepts as many as it has room for, the most reluctant to go elsewhere first; the
   tokens still left take the free places in expert order. The loads are exact; the total affinity is close to
   the optimum, not at it (on random affinities about 90-99% of the tokens where the exact solver puts them, fewer
   with many experts of few tokens each; the total affinity within about 2% of the optimum).

All arithmetic is batched over tokens; the loops are over rounds, augmenting paths (the excess left
after stage 1: a handful) and Bellman-Ford passes (at most ``E``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from . import kernel_choices
from .routing import count_ids

__all__ = ["balanced_assignment", "balanced_capacities", "resolve_solver", "Solver"]

Solver = Literal["auto", "exact", "sync_free"]


def balanced_capacities(num_tokens: int | Tensor, num_experts: int, device=None) -> Tensor:
    """``[E]`` capacities that differ by at most one and sum to ``num_tokens`` (an int, or a device scalar: then
    computed on its device, without reading it)."""
    if isinstance(num_tokens, Tensor):
        extra = (torch.arange(num_experts, device=num_tokens.device) < num_tokens % num_experts).long()
        return num_tokens // num_experts + extra
    base, extra = divmod(num_tokens, num_experts)
    caps = torch.full((num_experts,), base, dtype=torch.long, device=device)
    caps[:extra] += 1
    return caps


def resolve_solver(solver: Solver, device: torch.device) -> str:
    """``"auto"``: the solver ``BASE_SOLVERS`` of :mod:`moekit.moe.kernel_choices` names for ``device``'s type: the
    exact one on CPUs (host reads are free there), the sync-free one on accelerators."""
    if solver not in ("auto", "exact", "sync_free"):
        raise ValueError(f"solver={solver!r}; allowed: 'auto', 'exact', 'sync_free'")
    if solver == "auto":
        return kernel_choices.BASE_SOLVERS.get(device.type, "sync_free")
    return solver


def balanced_assignment(
    scores: Tensor,
    capacities: Tensor | None = None,
    price_rounds: int = 20,
    solver: Solver = "exact",
    fill_rounds: int = 4,
) -> Tensor:
    """Assign each of ``N`` tokens to one of ``E`` experts, expert ``e`` taking exactly ``c_e`` tokens,
    maximising the total score (see the module docstring).

    Args:
        scores: ``[N, E]`` token-expert affinities (higher is better); no gradient flows through the assignment.
        capacities: ``[E]`` long with ``sum == N``; default :func:`balanced_capacities`.
        price_rounds: rounds of stage 1; the exact solver stops early once no expert is over capacity.
        solver: ``"exact"`` (the optimum; reads the host: a custom operator under ``torch.compile``, which sees
            one opaque step of known output shape), ``"sync_free"`` (fixed rounds on the device, plain tensor
            operations, near the optimum), or ``"auto"`` (:func:`resolve_solver`).
        fill_rounds: the sync-free solver's rounds of proposals to experts with room.

    Returns:
        ``[N]`` long expert index per token.
    """
    if capacities is None:
        capacities = balanced_capacities(scores.shape[0], scores.shape[1], scores.device)
    if resolve_solver(solver, scores.device) == "exact":
        return _solve(scores.detach(), capacities, price_rounds)
    with torch.no_grad():
        return _solve_sync_free(scores.detach().float(), capacities.to(scores.device), price_rounds, fill_rounds)


def _sort_within_expert(expert: Tensor, key: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sort items by (expert, key descending). Returns the order, each expert's count and the start of its run."""
    by_key = torch.sort(key, descending=True, stable=True).indices
    order = by_key[torch.sort(expert.index_select(0, by_key), stable=True).indices]
    counts = count_ids(expert, num_experts)
    return order, counts, counts.cumsum(0) - counts


def _rank_within_expert(expert: Tensor, key: Tensor, num_experts: int) -> Tensor:
    """Each item's rank among its expert's items by ``key`` (0: the largest)."""
    order, _, starts = _sort_within_expert(expert, key, num_experts)
    rank_in_order = torch.arange(expert.numel(), device=expert.device) - starts[expert[order]]
    return torch.empty_like(expert).index_put_((order,), rank_in_order)


def _price_round(scores: Tensor, prices: Tensor, capacities: Tensor, min_step: Tensor | float):
    """One auction round: each token's best expert at ``prices``, which experts it over-subscribes, and the
    prices that clear them."""
    num_tokens, num_experts = scores.shape
    top = (scores - prices).topk(2, dim=1)
    choice = top.indices[:, 0]
    margin = top.values[:, 0] - top.values[:, 1]  # >= 0: preference for the chosen expert
    order, counts, starts = _sort_within_expert(choice, margin, num_experts)
    over = counts > capacities
    sorted_margin = margin.index_select(0, order)
    # Inside each over-full expert: the margin of the last token kept (rank c_e - 1) and of the
    # first moved (rank c_e). An expert of capacity 0 moves everyone.
    first_moved = sorted_margin.index_select(0, (starts + capacities).clamp(max=num_tokens - 1))
    last_kept = sorted_margin.index_select(0, (starts + capacities - 1).clamp(0, num_tokens - 1))
    last_kept = torch.where(capacities > 0, last_kept, first_moved + 2 * min_step)
    return choice, over, prices + torch.where(over, ((last_kept + first_moved) / 2).clamp_min(min_step), 0.0)


@torch.library.custom_op("moekit::balanced_assignment", mutates_args=())
def _solve(scores: Tensor, capacities: Tensor, price_rounds: int) -> Tensor:
    num_tokens, num_experts = scores.shape
    device = scores.device
    capacities = capacities.to(device=device, dtype=torch.long)
    if capacities.shape != (num_experts,) or int(capacities.sum()) != num_tokens or bool((capacities < 0).any()):
        raise ValueError(
            f"balanced_assignment: capacities {capacities.tolist()} must be {num_experts} values >= 0 "
            f"summing to the {num_tokens} tokens"
        )
    if num_experts == 1 or num_tokens == 0:
        return torch.zeros(num_tokens, dtype=torch.long, device=device)

    scores = scores.double()
    min_step = 1e-4 * float(scores.std()) + 1e-12
    prices = torch.zeros(num_experts, dtype=torch.float64, device=device)
    for _ in range(price_rounds):
        choice, over, prices = _price_round(scores, prices, capacities, min_step)
        if not bool(over.any()):
            return choice.clone()
    choice = (scores - prices).argmax(dim=1)
    return _successive_shortest_paths(scores, choice, capacities)


@_solve.register_fake
def _(scores: Tensor, capacities: Tensor, price_rounds: int) -> Tensor:
    return scores.new_empty(scores.shape[0], dtype=torch.long)


def _solve_sync_free(scores: Tensor, capacities: Tensor, price_rounds: int, fill_rounds: int) -> Tensor:
    """The ``"sync_free"`` solver (module docstring): every loop has a fixed count, every choice is a tensor."""
    num_tokens, num_experts = scores.shape
    if capacities.shape != (num_experts,):
        raise ValueError(f"balanced_assignment: capacities of shape {tuple(capacities.shape)}, not ({num_experts},)")
    if num_experts == 1 or num_tokens == 0:
        return torch.zeros(num_tokens, dtype=torch.long, device=scores.device)
    torch._assert_async(capacities.sum() == num_tokens, "balanced_assignment: capacities must sum to the tokens")
    min_step = 1e-4 * scores.std() + 1e-12
    prices = scores.new_zeros(num_experts)
    for _ in range(price_rounds):
        _, _, prices = _price_round(scores, prices, capacities, min_step)
    value = scores - prices
    # Each expert keeps the c_e claimants with the largest margin over their second choice.
    top = value.topk(2, dim=1)
    choice = top.indices[:, 0]
    assigned = _rank_within_expert(choice, top.values[:, 0] - top.values[:, 1], num_experts) < capacities[choice]
    room = capacities - _placed(choice, assigned, num_experts)
    big = torch.finfo(value.dtype).max
    for _ in range(fill_rounds):
        # Every token left over proposes to its best expert with room (placed tokens to a bucket E of their own);
        # each expert accepts as many as it has room for, largest regret (best minus second best with room) first.
        top = value.masked_fill(room == 0, float("-inf")).topk(2, dim=1)
        want = torch.where(assigned, num_experts, top.indices[:, 0])
        regret = torch.nan_to_num(top.values[:, 0] - top.values[:, 1], nan=0.0, posinf=big)
        rank = _rank_within_expert(want, regret, num_experts + 1)
        accept = rank < torch.cat([room, room.new_zeros(1)]).index_select(0, want)
        choice = torch.where(accept, want, choice)
        assigned = assigned | accept
        room = room - _placed(want, accept, num_experts)
    # The tokens still left (the j-th of them) take the free places in expert order (the j-th free place).
    free_end = room.cumsum(0)
    place = torch.searchsorted(free_end, (~assigned).long().cumsum(0) - 1, right=True).clamp_(max=num_experts - 1)
    return torch.where(assigned, choice, place)


def _placed(expert: Tensor, placed: Tensor, num_experts: int) -> Tensor:
    """``[E]``: how many of the tokens with ``placed`` set go to each expert."""
    return count_ids(torch.where(placed, expert, num_experts), num_experts + 1)[:num_experts]


def _successive_shortest_paths(scores: Tensor, choice: Tensor, capacities: Tensor) -> Tensor:
    """Stage 2 of :func:`balanced_assignment`: from an assignment that is optimal for its own loads,
    move tokens along cheapest paths from over-full to under-full experts until the loads are exact."""
    num_tokens, num_experts = scores.shape
    tokens = torch.arange(num_tokens, device=scores.device)
    inf = float("inf")
    while True:
        excess = torch.bincount(choice, minlength=num_experts) - capacities
        if not bool((excess > 0).any()):
            return choice
        move_cost = scores[tokens, choice].unsqueeze(1) - scores  # [N, E]: loss of moving n to e
        edge = torch.full((num_experts, num_experts), inf, dtype=scores.dtype, device=scores.device)
        edge.scatter_reduce_(0, choice.unsqueeze(1).expand(-1, num_experts), move_cost, "amin")
        edge.fill_diagonal_(inf)
        # Bellman-Ford from every over-full expert at once (edges may be negative, cycles are not).
        dist = torch.where(excess > 0, 0.0, inf).to(scores.dtype)
        pred = torch.full((num_experts,), -1, dtype=torch.long, device=scores.device)
        for _ in range(num_experts):
            best, arg = (dist.unsqueeze(1) + edge).min(dim=0)
            better = best < dist - 1e-12
            if not bool(better.any()):
                break
            dist = torch.where(better, best, dist)
            pred = torch.where(better, arg, pred)
        node = int(torch.where(excess < 0, dist, inf).argmin())
        for _ in range(num_experts):  # walk the path back; move one token per edge, last edge first
            source = int(pred[node])
            if source < 0:
                break
            candidates = torch.where(choice == source, move_cost[:, node], inf)
            choice[int(candidates.argmin())] = node
            node = source
