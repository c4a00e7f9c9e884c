"""Balanced token-to-expert assignment for BASE layers (Lewis et al. 2021).

Problem: given affinities ``scores [N, E]`` and capacities ``c_e`` with ``sum c_e = N``, find
``a: tokens -> experts`` maximising ``sum_n scores[n, a(n)]`` with exactly ``c_e`` tokens per expert
(a transportation problem; its dual has one price per expert).

Method, exact, in two stages that both keep the assignment optimal for the loads it has:

1. *Price auction* (bulk). Every token takes its best expert at the current prices,
   ``argmax_e scores[n, e] - price[e]``. Each over-subscribed expert raises its price to the
   market-clearing level: halfway between the ``c_e``-th and ``(c_e + 1)``-th largest margins of its
   claimants (a token's margin is its preference for this expert over its second best), so that
   only ``c_e`` of them still prefer it. A few rounds remove almost all excess.
2. *Successive shortest paths* (finish). While an expert is over capacity, move one token along the
   cheapest chain of moves from an over-full to an under-full expert: a Bellman-Ford search on the
   ``E x E`` graph whose edge ``e -> e'`` costs the smallest score loss of moving a token of ``e`` to
   ``e'``. Because every token held its best expert at the end of stage 1, this is the classical
   successive-shortest-path algorithm for min-cost flow and ends at the optimum.

All arithmetic is batched over tokens; the loops are over rounds, augmenting paths (the excess left
after stage 1: a handful) and Bellman-Ford passes (at most ``E``). Each loop step checks a condition
on the host: BASE routing is a data-dependent solve and synchronises by nature. Under ``torch.compile`` the solver is
one custom operator, opaque to it, so its host reads break no graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["balanced_assignment", "balanced_capacities"]


def balanced_capacities(num_tokens: int, num_experts: int, device=None) -> Tensor:
    """``[E]`` capacities that differ by at most one and sum to ``num_tokens``."""
    base, extra = divmod(num_tokens, num_experts)
    caps = torch.full((num_experts,), base, dtype=torch.long, device=device)
    caps[:extra] += 1
    return caps


def _sort_within_expert(expert: Tensor, key: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Sort items by (expert, key descending). Returns the order and the start of each expert's run."""
    by_key = torch.sort(key, descending=True, stable=True).indices
    order = by_key[torch.sort(expert.index_select(0, by_key), stable=True).indices]
    counts = torch.bincount(expert, minlength=num_experts)
    return order, counts.cumsum(0) - counts


def balanced_assignment(scores: Tensor, capacities: Tensor | None = None, price_rounds: int = 20) -> Tensor:
    """Assign each of ``N`` tokens to one of ``E`` experts, expert ``e`` taking exactly ``c_e`` tokens,
    maximising the total score (see the module docstring). A custom operator: ``torch.compile`` sees one opaque
    step of known output shape, so the solver's host reads break no graph.

    Args:
        scores: ``[N, E]`` token-expert affinities (higher is better); no gradient flows through the assignment.
        capacities: ``[E]`` long with ``sum == N``; default :func:`balanced_capacities`.
        price_rounds: rounds of stage 1 before the exact finish; more rounds leave fewer paths.

    Returns:
        ``[N]`` long expert index per token.
    """
    if capacities is None:
        capacities = balanced_capacities(scores.shape[0], scores.shape[1], scores.device)
    return _solve(scores.detach(), capacities, price_rounds)


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
        top = (scores - prices).topk(2, dim=1)
        choice = top.indices[:, 0]
        over = torch.bincount(choice, minlength=num_experts) > capacities
        if not bool(over.any()):
            return choice.clone()
        margin = top.values[:, 0] - top.values[:, 1]  # >= 0: preference for the chosen expert
        order, starts = _sort_within_expert(choice, margin, num_experts)
        sorted_margin = margin.index_select(0, order)
        # Inside each over-full expert: the margin of the last token kept (rank c_e - 1) and of the
        # first moved (rank c_e). An expert of capacity 0 moves everyone.
        first_moved = sorted_margin.index_select(0, (starts + capacities).clamp(max=num_tokens - 1))
        last_kept = sorted_margin.index_select(0, (starts + capacities - 1).clamp(0, num_tokens - 1))
        last_kept = torch.where(capacities > 0, last_kept, first_moved + 2 * min_step)
        prices += torch.where(over, ((last_kept + first_moved) / 2).clamp_min(min_step), 0.0)
    choice = (scores - prices).argmax(dim=1)
    return _successive_shortest_paths(scores, choice, capacities)


@_solve.register_fake
def _(scores: Tensor, capacities: Tensor, price_rounds: int) -> Tensor:
    return scores.new_empty(scores.shape[0], dtype=torch.long)


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
