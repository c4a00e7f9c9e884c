"""Routing statistics of one forward, computed on device with no host synchronisation.

Every function returns ``{name: tensor}`` of detached scalars, except ``expert_load`` (``[E]``, the
fraction of routed work each expert received; it sums to 1). With ``mask: [N]`` bool (False for padding) the
statistics are over the real tokens alone; ``real_tokens`` (:data:`REAL_TOKENS`) is their number, the weight of the
forward's statistics when a reader averages them over forwards (padding counts in no statistic, nor in its weight).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .losses import masked_mean

__all__ = [
    "REAL_TOKENS",
    "real_tokens",
    "entropy",
    "tokens_choice_stats",
    "experts_choice_stats",
    "strictly_balanced_stats",
    "soft_moe_stats",
    "dense_mixture_stats",
]


REAL_TOKENS = "real_tokens"


def real_tokens(like: Tensor, num_tokens: int, mask: Tensor | None) -> Tensor:
    """The real tokens of a forward of ``num_tokens`` as a float32 device scalar (no host synchronisation)."""
    return like.new_full((), float(num_tokens), dtype=torch.float32) if mask is None else mask.sum().float()


def entropy(probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy in nats along ``dim`` (``0 log 0 = 0``)."""
    return -(probs * torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))).sum(dim)


@torch.no_grad()
def tokens_choice_stats(
    router_probs: Tensor, kept_counts: Tensor, gates: Tensor, keep: Tensor, mask: Tensor | None = None
) -> dict[str, Tensor]:
    """Statistics of tokens-choice routing.

    Args:
        router_probs: ``[N, E]`` router distribution over experts.
        kept_counts: ``[E]`` assignments each expert processed (after capacity).
        gates: ``[N, k]`` gate values of the chosen experts.
        keep: ``[N, k]`` bool, False for assignments dropped by capacity (and for padding).
        mask: ``[N]`` bool, the real tokens (None: all).
    """
    total = keep.numel() if mask is None else (mask.sum() * keep.shape[1]).clamp_min(1)
    kept = kept_counts.sum().float()
    return {
        "expert_load": kept_counts.float() / kept.clamp_min(1.0),
        "load_cv": _cv(kept_counts.float()),
        "unused_experts": (kept_counts == 0).float().mean(),
        "dropped_fraction": 1.0 - kept / total,
        "tokens_fully_dropped": masked_mean((~keep.any(dim=-1)).float(), mask),
        "router_entropy": masked_mean(entropy(router_probs.float()), mask),
        "mean_top_gate": masked_mean(gates.float().amax(dim=-1), mask),  # not gates[:, 0]: a balancing bias reorders
        REAL_TOKENS: real_tokens(router_probs, router_probs.shape[0], mask),
    }


@torch.no_grad()
def experts_choice_stats(
    router_probs: Tensor, experts_per_token: Tensor, gates: Tensor, mask: Tensor | None = None
) -> dict[str, Tensor]:
    """Statistics of experts-choice routing.

    Args:
        router_probs: ``[N, E]``; experts_per_token: ``[N]`` how many experts picked each token;
        gates: ``[E, C]`` gate values of the picked tokens (0 in a slot left empty); mask: ``[N]`` the real tokens.
    """
    num_experts = router_probs.shape[-1]
    return {
        "expert_load": torch.full((num_experts,), 1.0 / num_experts, device=router_probs.device),
        "load_cv": router_probs.new_zeros(()),
        "unused_experts": router_probs.new_zeros(()),
        "dropped_fraction": masked_mean((experts_per_token == 0).float(), mask),
        "mean_experts_per_token": masked_mean(experts_per_token.float(), mask),
        "router_entropy": masked_mean(entropy(router_probs.float()), mask),
        "mean_top_gate": gates.float().max(dim=-1).values.mean(),
        REAL_TOKENS: real_tokens(router_probs, router_probs.shape[0], mask),
    }


@torch.no_grad()
def strictly_balanced_stats(
    router_probs: Tensor, mask: Tensor, counts: Tensor, thresholds: Tensor | None, token_mask: Tensor | None = None
) -> dict[str, Tensor]:
    """Statistics of strictly balanced gating (:class:`~moekit.moe.StrictlyBalancedMoE`).

    Args:
        router_probs: ``[N, E]`` gate scores; mask: ``[N, E]`` bool, the (batchwise or threshold) mask used;
        counts: ``[E]`` tokens each expert processed; thresholds: ``[E]`` in training (then
        ``threshold_agreement`` is the fraction of ``(token, expert)`` entries where the threshold mask equals
        the batchwise one), None at inference; token_mask: ``[N]`` the real tokens (None: all).
    """
    per_token = mask.sum(dim=-1)
    kept_probs = router_probs * mask
    stats = {
        "expert_load": counts.float() / counts.sum().clamp_min(1).float(),
        "load_cv": _cv(counts.float()),
        "unused_experts": (counts == 0).float().mean(),
        "dropped_fraction": masked_mean((per_token == 0).float(), token_mask),
        "mean_experts_per_token": masked_mean(per_token.float(), token_mask),
        "router_entropy": masked_mean(entropy(router_probs.float()), token_mask),
        "mean_top_gate": masked_mean(
            kept_probs.max(dim=-1).values / kept_probs.sum(dim=-1).clamp_min(1e-30), token_mask
        ),
        REAL_TOKENS: real_tokens(router_probs, router_probs.shape[0], token_mask),
    }
    if thresholds is not None:
        agree = ((router_probs > thresholds) == mask).float().mean(dim=-1)
        stats["threshold_agreement"] = masked_mean(agree, token_mask)
    return stats


@torch.no_grad()
def soft_moe_stats(dispatch: Tensor, combine: Tensor, num_experts: int, token_mask: Tensor | None) -> dict[str, Tensor]:
    """Statistics of Soft MoE routing.

    Args:
        dispatch: ``[B, M, S]`` dispatch weights (softmax over tokens ``M`` per slot).
        combine: ``[B, M, S]`` combine weights (softmax over slots ``S`` per token).
        num_experts: experts ``n``; slot ``s`` belongs to expert ``s // (S // n)``.
        token_mask: ``[B, M]`` bool of real (not padding) tokens, or None.

    ``tokens_per_slot`` is the perplexity ``exp(H)`` of a slot's dispatch distribution: the effective
    number of tokens mixed into the slot. ``expert_load`` is each expert's share of the combine mass.
    """
    num_slots = combine.shape[-1]
    # a sequence of padding alone dispatches uniformly over it (finite weights): its slots count in no statistic
    sequences = None if token_mask is None else token_mask.any(dim=1)  # [B]
    dispatch_entropy = entropy(dispatch.float(), dim=1)  # [B, S]
    combine_entropy = entropy(combine.float(), dim=2)  # [B, M]
    max_combine = combine.float().amax(dim=2)  # [B, M]
    if token_mask is None:
        combine_entropy_mean = combine_entropy.mean()
        max_combine_mean = max_combine.mean()
        slot_mass = combine.float().sum(dim=(0, 1))  # [S]
    else:
        mask = token_mask.float()
        count = mask.sum().clamp_min(1.0)
        combine_entropy_mean = (combine_entropy * mask).sum() / count
        max_combine_mean = (max_combine * mask).sum() / count
        slot_mass = (combine.float() * mask.unsqueeze(-1)).sum(dim=(0, 1))
    expert_mass = slot_mass.view(num_experts, num_slots // num_experts).sum(dim=-1)  # slots of expert i: i*p..i*p+p-1
    load = expert_mass / expert_mass.sum().clamp_min(torch.finfo(expert_mass.dtype).tiny)
    return {
        "expert_load": load,
        "load_cv": _cv(load),
        "dropped_fraction": dispatch.new_zeros((), dtype=torch.float32),
        "dispatch_entropy": masked_mean(dispatch_entropy, sequences).mean(),
        "combine_entropy": combine_entropy_mean,
        "max_dispatch_weight": masked_mean(dispatch.float().amax(dim=1), sequences).mean(),
        "max_combine_weight": max_combine_mean,
        "tokens_per_slot": masked_mean(dispatch_entropy.exp(), sequences).mean(),
        REAL_TOKENS: real_tokens(combine, combine.shape[0] * combine.shape[1], token_mask),
    }


@torch.no_grad()
def dense_mixture_stats(gates: Tensor, mask: Tensor | None = None) -> dict[str, Tensor]:
    """Statistics of a dense mixture: ``gates [N, E]`` softmax weights of every expert; ``mask [N]`` the real
    tokens."""
    load = masked_mean(gates.float(), mask)
    return {
        "expert_load": load,
        "load_cv": _cv(load),
        "dropped_fraction": gates.new_zeros((), dtype=torch.float32),
        "router_entropy": masked_mean(entropy(gates.float()), mask),
        "mean_top_gate": masked_mean(gates.float().max(dim=-1).values, mask),
        REAL_TOKENS: real_tokens(gates, gates.shape[0], mask),
    }


def _cv(values: Tensor) -> Tensor:
    mean = values.mean()
    return values.std(unbiased=False) / mean.clamp_min(torch.finfo(values.dtype).tiny)
