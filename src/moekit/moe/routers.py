"""Routers for tokens-choice layers: each maps tokens ``x: [N, d]`` to ``k`` experts per token.

All routers compute in float32, also under autocast. Each returns a :class:`Routing`; the layers in
:mod:`moekit.moe.token_choice` turn it into capacity, dispatch and combine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .assignment import balanced_assignment, balanced_capacities
from .losses import (
    cv_squared,
    importance_loss,
    load_loss,
    load_probabilities,
    router_z_loss,
    smooth_load,
    switch_load_balancing_loss,
)

__all__ = [
    "Routing",
    "TopKRouter",
    "HashRouter",
    "BalancedRouter",
    "HierarchicalRouter",
    "logit_checksum",
    "router_logits",
    "router_precision",
    "router_weight",
]


@dataclass
class Routing:
    """A router's decision for ``N`` tokens.

    Attributes:
        expert_ids: ``[N, k]`` long, the chosen experts, best first.
        gates: ``[N, k]`` float32 combine weights.
        probs: ``[N, E]`` float32 router distribution (for statistics), or None.
        priority: ``[N]`` score for Batch Prioritized Routing (the top router score), or None.
        aux_losses: weighted auxiliary losses of this routing.
        logit_checksum: :func:`logit_checksum` of the router's logits (None: no learned logits, as
            in hash routing).
    """

    expert_ids: Tensor
    gates: Tensor
    probs: Tensor | None = None
    priority: Tensor | None = None
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    logit_checksum: Tensor | None = None


def router_weight(num_experts: int, in_features: int, device=None, dtype=None) -> nn.Parameter:
    """A ``[E, d]`` router projection with ``nn.Linear``'s default initialisation."""
    weight = nn.Parameter(torch.empty(num_experts, in_features, device=device, dtype=dtype))
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


def router_precision(t: Tensor) -> Tensor:
    """``t`` in float32 if it is in a lower precision (bf16/fp16); float32/float64 stay as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """``x [N, d] @ weight[E, d]^T`` in (at least) float32 with autocast off."""
    with torch.autocast(x.device.type, enabled=False):
        x = router_precision(x)
        return F.linear(x, weight.to(x.dtype))


def logit_checksum(*logits: Tensor) -> Tensor:
    """The sum of every entry of ``logits`` as a detached float32 device scalar: finite exactly when every
    logit is finite (NaN and inf propagate through a sum; finite logits would have to exceed ~1e38 in
    total to overflow, itself a divergence). One reduction per tensor and no host synchronisation, so
    layers record it on every forward and a reader (:class:`~moekit.callbacks.NonFiniteGuard`) syncs
    only when a training step has already gone bad."""
    total = logits[0].detach().float().sum()
    for t in logits[1:]:
        total = total + t.detach().float().sum()
    return total


def _check_k(num_experts: int, top_k: int, name: str) -> None:
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{name}: num_experts={num_experts!r} must be a positive int")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{name}: top_k={top_k!r} must be an int in [1, num_experts={num_experts}]")


class TopKRouter(nn.Module):
    """Tokens-choice top-k gating.

    ``scores = softmax(x W_g^T)`` over experts (or ``sigmoid``, DeepSeek-V3), the ``k`` best experts
    are chosen, and their scores are the gates; ``normalize_gates`` divides them by their sum
    (GShard/Mixtral top-2). ``k = 1`` without normalisation is the Switch router.

    Noisy top-k gating (Shazeer et al. 2017, ``noisy_gating=True``): in training the logits are
    ``H = x W_g + eps * softplus(x W_noise)`` with ``eps ~ N(0, 1)``; ``W_noise`` starts at zero.

    Loss-free balancing (Wang et al. 2024, DeepSeek-V3; ``bias_update_rate > 0``): a per-expert bias
    ``b`` is added to the scores for the *choice* of experts only (gates use the unbiased scores).
    Token counts accumulate during forwards; :meth:`balancing_step` applies
    ``b_i += rate * sign(mean load - load_i)`` and is called once per optimizer step.

    Auxiliary losses, each on when its weight is non-zero: ``switch`` (Fedus et al.), ``importance``
    and ``load`` (Shazeer et al.; ``load`` needs noisy gating), ``z`` (ST-MoE router z-loss).
    """

    def __init__(
        self,
        in_features: int,
        num_experts: int,
        top_k: int = 1,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        normalize_gates: bool = False,
        noisy_gating: bool = False,
        bias_update_rate: float = 0.0,
        switch_loss_weight: float = 0.0,
        importance_loss_weight: float = 0.0,
        load_loss_weight: float = 0.0,
        z_loss_weight: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check_k(num_experts, top_k, "TopKRouter")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"TopKRouter: score_func={score_func!r}; allowed: 'softmax', 'sigmoid'")
        for name, value in (
            ("bias_update_rate", bias_update_rate),
            ("switch_loss_weight", switch_loss_weight),
            ("importance_loss_weight", importance_loss_weight),
            ("load_loss_weight", load_loss_weight),
            ("z_loss_weight", z_loss_weight),
        ):
            if value < 0:
                raise ValueError(f"TopKRouter: {name}={value!r} must be >= 0 (0 turns it off)")
        if load_loss_weight > 0 and not noisy_gating:
            raise ValueError(
                f"TopKRouter: load_loss_weight={load_loss_weight} needs noisy_gating=True (Shazeer's load estimator "
                "is defined through the gating noise); use importance_loss_weight or switch_loss_weight instead"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.normalize_gates = normalize_gates
        self.noisy_gating = noisy_gating
        self.bias_update_rate = bias_update_rate
        self.loss_weights = {
            "switch": switch_loss_weight,
            "importance": importance_loss_weight,
            "load": load_loss_weight,
            "z": z_loss_weight,
        }
        self.weight = router_weight(num_experts, in_features, device, dtype)
        self.noise_weight = (
            nn.Parameter(torch.zeros(num_experts, in_features, device=device, dtype=dtype)) if noisy_gating else None
        )
        if bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
            self.register_buffer("pending_counts", torch.zeros(num_experts, device=device))
        else:
            self.expert_bias = None
            self.pending_counts = None

    def forward(self, x: Tensor) -> Routing:
        """``x: [N, d]`` -> :class:`Routing` with ``k`` experts per token."""
        clean = router_logits(x, self.weight)
        logits = clean
        noise_std = None
        if self.noisy_gating and self.training:
            noise_std = F.softplus(router_logits(x, self.noise_weight))
            logits = clean + torch.randn_like(clean) * noise_std
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice_scores = scores if self.expert_bias is None else scores + self.expert_bias
        expert_ids = choice_scores.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, expert_ids)
        if self.normalize_gates:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        if self.pending_counts is not None and self.training:
            with torch.no_grad():
                self.pending_counts += torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).float()

        w = self.loss_weights
        losses: dict[str, Tensor] = {}
        if w["switch"]:
            losses["switch"] = w["switch"] * switch_load_balancing_loss(probs, expert_ids, self.num_experts)
        if w["importance"]:
            dense_gates = torch.zeros_like(scores).scatter(1, expert_ids, gates)
            losses["importance"] = w["importance"] * importance_loss(dense_gates)
        if w["load"] and noise_std is not None:
            losses["load"] = w["load"] * load_loss(clean, logits, noise_std, self.top_k)
        if w["z"]:
            losses["z"] = w["z"] * router_z_loss(logits)
        return Routing(
            expert_ids,
            gates,
            probs,
            priority=scores.max(dim=-1).values,
            aux_losses=losses,
            logit_checksum=logit_checksum(logits),
        )

    @torch.no_grad()
    def balancing_step(self) -> None:
        """Loss-free balancing update from the token counts since the previous call."""
        if self.expert_bias is None:
            return
        counts = self.pending_counts
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        counts.zero_()

    @torch.no_grad()
    def discard_balancing_step(self) -> None:
        """Forget the token counts since the previous update without applying them (the optimizer
        step they belong to was skipped)."""
        if self.pending_counts is not None:
            self.pending_counts.zero_()


class HashRouter(nn.Module):
    """Hash routing (Roller et al. 2021): a fixed, balanced random map token id -> expert.

    ``vocab_size`` ids are split into ``num_experts`` groups of (nearly) equal size by a seeded
    permutation; a token goes to its id's expert with gate 1. No parameters are learned.
    """

    def __init__(self, num_experts: int, vocab_size: int, seed: int = 0, device=None) -> None:
        super().__init__()
        _check_k(num_experts, 1, "HashRouter")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"HashRouter: vocab_size={vocab_size!r} must be a positive int")
        self.num_experts = num_experts
        self.vocab_size = vocab_size
        generator = torch.Generator().manual_seed(seed)
        perm = torch.randperm(vocab_size, generator=generator)
        table = torch.empty(vocab_size, dtype=torch.long)
        table[perm] = torch.arange(vocab_size) % num_experts
        self.register_buffer("expert_of_token", table.to(device))

    def forward(self, token_ids: Tensor) -> Routing:
        """``token_ids: [N]`` long -> :class:`Routing` with ``k = 1`` and gates 1."""
        expert_ids = self.expert_of_token.index_select(0, token_ids.reshape(-1)).unsqueeze(1)
        gates = torch.ones(expert_ids.shape, device=token_ids.device)
        return Routing(expert_ids, gates)


class BalancedRouter(nn.Module):
    """BASE layer routing (Lewis et al. 2021).

    Affinities ``s = x W^T`` (one learned embedding per expert). In training, the assignment
    maximising the total affinity with every expert taking ``N / E`` tokens (±1 when ``E`` does not
    divide ``N``) is solved by :func:`balanced_assignment`; at inference each token takes its best
    expert. The gate is ``sigmoid(s[n, a(n)])``, the paper's residual weighting.
    """

    def __init__(self, in_features: int, num_experts: int, device=None, dtype=None):
        super().__init__()
        _check_k(num_experts, 1, "BalancedRouter")
        self.num_experts = num_experts
        self.weight = router_weight(num_experts, in_features, device, dtype)

    def forward(self, x: Tensor) -> Routing:
        scores = router_logits(x, self.weight)
        if self.training:
            caps = balanced_capacities(x.shape[0], self.num_experts, x.device)
            # Non-finite scores would keep the assignment's auction from ending: assign as if they were 0.
            # The gates below still carry them, so the loss is non-finite and NonFiniteGuard skips the step.
            finite = torch.nan_to_num(scores.detach(), nan=0.0, posinf=0.0, neginf=0.0)
            expert_ids = balanced_assignment(finite, caps).unsqueeze(1)
        else:
            expert_ids = scores.argmax(dim=-1, keepdim=True)
        gates = torch.sigmoid(scores.gather(1, expert_ids))
        return Routing(
            expert_ids, gates, torch.softmax(scores, dim=-1), priority=None, logit_checksum=logit_checksum(scores)
        )


class HierarchicalRouter(nn.Module):
    """Two-level noisy top-k gating of Shazeer et al. 2017, appendix B.

    A primary gate picks ``top_k_groups`` of ``num_groups`` groups; inside each chosen group ``i`` a
    secondary gate picks ``top_k`` of its ``experts_per_group`` experts. Expert ``(i, j)`` has flat
    index ``i * experts_per_group + j`` and gate ``G_primary(x)_i * G_i(x)_j``. Both levels use noisy
    top-k gating with renormalised gates (Shazeer's ``softmax(KeepTopK(H))``).

    Losses (appendix B): ``importance`` is ``CV^2`` of ``Importance_H[i, j] = sum_x G_p(x)_i G_i(x)_j``,
    ``load`` is ``CV^2`` of ``Load_H[i, j] = Load_p(X)_i * Load_i(X^(i))_j / |X^(i)|``, ``X^(i)``
    being the tokens the primary gate sends to group ``i``.
    """

    def __init__(
        self,
        in_features: int,
        num_groups: int,
        experts_per_group: int,
        top_k_groups: int = 1,
        top_k: int = 2,
        noisy_gating: bool = True,
        importance_loss_weight: float = 0.0,
        load_loss_weight: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check_k(num_groups, top_k_groups, "HierarchicalRouter (groups)")
        _check_k(experts_per_group, top_k, "HierarchicalRouter (experts per group)")
        if load_loss_weight > 0 and not noisy_gating:
            raise ValueError(f"HierarchicalRouter: load_loss_weight={load_loss_weight} needs noisy_gating=True")
        self.num_groups = num_groups
        self.experts_per_group = experts_per_group
        self.top_k_groups = top_k_groups
        self.top_k = top_k
        self.noisy_gating = noisy_gating
        self.importance_loss_weight = importance_loss_weight
        self.load_loss_weight = load_loss_weight
        dd = {"device": device, "dtype": dtype}
        self.primary_weight = router_weight(num_groups, in_features, **dd)
        self.secondary_weight = router_weight(num_groups * experts_per_group, in_features, **dd)
        if noisy_gating:
            self.primary_noise = nn.Parameter(torch.zeros(num_groups, in_features, **dd))
            self.secondary_noise = nn.Parameter(torch.zeros(num_groups * experts_per_group, in_features, **dd))
        else:
            self.primary_noise = self.secondary_noise = None

    def _noisy(self, x: Tensor, weight: Tensor, noise_weight: Tensor | None):
        clean = router_logits(x, weight)
        if noise_weight is None or not self.training:
            return clean, clean, None
        noise_std = F.softplus(router_logits(x, noise_weight))
        return clean, clean + torch.randn_like(clean) * noise_std, noise_std

    @staticmethod
    def _keep_top_k_softmax(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        top = logits.topk(k, dim=-1)
        return top.indices, torch.softmax(top.values, dim=-1)

    def forward(self, x: Tensor) -> Routing:
        num_tokens = x.shape[0]
        groups, per_group = self.num_groups, self.experts_per_group
        p_clean, p_noisy, p_std = self._noisy(x, self.primary_weight, self.primary_noise)
        group_ids, group_gates = self._keep_top_k_softmax(p_noisy, self.top_k_groups)  # [N, kg]
        s_clean, s_noisy, s_std = self._noisy(x, self.secondary_weight, self.secondary_noise)
        s_noisy = s_noisy.view(num_tokens, groups, per_group)
        local_ids, local_gates = self._keep_top_k_softmax(s_noisy, self.top_k)  # [N, G, k]
        # Keep the secondary choices of the chosen groups only.
        idx = group_ids.unsqueeze(-1).expand(-1, -1, self.top_k)
        chosen_local = local_ids.gather(1, idx)  # [N, kg, k]
        chosen_gates = local_gates.gather(1, idx) * group_gates.unsqueeze(-1)
        expert_ids = (group_ids.unsqueeze(-1) * per_group + chosen_local).reshape(num_tokens, -1)
        gates = chosen_gates.reshape(num_tokens, -1)
        order = gates.argsort(dim=-1, descending=True)  # best first, as other routers
        expert_ids, gates = expert_ids.gather(1, order), gates.gather(1, order)

        losses: dict[str, Tensor] = {}
        if self.importance_loss_weight:
            dense = torch.zeros(num_tokens, groups * per_group, device=x.device).scatter(1, expert_ids, gates)
            losses["importance"] = self.importance_loss_weight * importance_loss(dense)
        if self.load_loss_weight and p_std is not None:
            load_primary = smooth_load(p_clean, p_noisy, p_std, self.top_k_groups)  # [G]
            in_group = torch.zeros(num_tokens, groups, device=x.device).scatter(1, group_ids, 1.0)  # X^(i) mask
            flat = (num_tokens * groups, per_group)  # every group's secondary gate as its own row
            per_token = load_probabilities(
                s_clean.reshape(flat), s_noisy.reshape(flat), s_std.reshape(flat), self.top_k
            ).view(num_tokens, groups, per_group)
            load_secondary = (per_token * in_group.unsqueeze(-1)).sum(0)  # [G, per_group]
            group_size = in_group.sum(0).clamp_min(1.0)
            load_h = load_primary.unsqueeze(-1) * load_secondary / group_size.unsqueeze(-1)
            losses["load"] = self.load_loss_weight * cv_squared(load_h.reshape(-1))
        probs = torch.softmax(p_noisy, -1).repeat_interleave(per_group, dim=1) * torch.softmax(s_noisy, -1).reshape(
            num_tokens, -1
        )
        return Routing(
            expert_ids,
            gates,
            probs,
            priority=gates[:, 0],
            aux_losses=losses,
            logit_checksum=logit_checksum(p_noisy, s_noisy),
        )
