"""Hierarchical gating (Shazeer et al. 2017, appendix B): a primary gate over groups of experts and a secondary gate
inside each chosen group."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .losses import cv_squared, importance_loss, load_probabilities, smooth_load
from .routing import (
    Router,
    Routing,
    check_loss_weights,
    check_router_init,
    check_top_k,
    expert_softmax,
    logit_checksum,
    reset_own_parameters,
    router_logits,
    router_weight,
)

__all__ = ["HierarchicalRouter"]


def _balanced_divisor(n: int) -> int:
    """The largest divisor ``d`` of ``n`` with ``d * d <= n`` (16 -> 4, 8 -> 2, 256 -> 16)."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


class HierarchicalRouter(Router):
    """Two-level noisy top-k gating of Shazeer et al. 2017, appendix B.

    The ``num_experts`` experts come in ``num_groups`` equal groups (None: the largest divisor of
    ``num_experts`` not above its square root). A primary gate picks ``top_k_groups`` groups; inside each
    chosen group ``i`` a secondary gate picks ``top_k`` of its experts, so a token uses
    ``top_k_groups * top_k`` experts (:attr:`top_k`). Expert ``(i, j)`` has flat index
    ``i * experts_per_group + j`` and gate ``G_primary(x)_i * G_i(x)_j``. Both levels use noisy top-k gating
    with renormalised gates (Shazeer's ``softmax(KeepTopK(H))``).

    Losses (appendix B): ``importance`` is ``CV^2`` of ``Importance_H[i, j] = sum_x G_p(x)_i G_i(x)_j``,
    ``load`` is ``CV^2`` of ``Load_H[i, j] = Load_p(X)_i * Load_i(X^(i))_j / |X^(i)|``, ``X^(i)``
    being the tokens the primary gate sends to group ``i``. ``router_init="zeros"`` starts both gates at zero
    (appendix A).
    """

    @dataclass(kw_only=True)
    class Config:
        num_experts: int = 16
        num_groups: int | None = None
        top_k_groups: int = 1
        top_k: int = 2
        noisy_gating: bool = True
        router_init: Literal["default", "zeros"] = "default"
        importance_loss_weight: float = 0.0
        load_loss_weight: float = 0.0

        def __post_init__(self) -> None:
            check_top_k(self.num_experts, 1)
            check_router_init(self.router_init)
            if self.num_groups is None:
                self.num_groups = _balanced_divisor(self.num_experts)
            if (
                isinstance(self.num_groups, bool)
                or not isinstance(self.num_groups, int)
                or self.num_groups < 1
                or (self.num_experts % self.num_groups)
            ):
                raise ValueError(
                    f"num_groups={self.num_groups!r} must divide num_experts={self.num_experts} (the experts "
                    "come in equal groups); null picks a divisor"
                )
            check_top_k(self.num_groups, self.top_k_groups, "top_k_groups")
            check_top_k(self.num_experts // self.num_groups, self.top_k, "top_k (experts per chosen group)")
            check_loss_weights(
                importance_loss_weight=self.importance_loss_weight, load_loss_weight=self.load_loss_weight
            )
            if self.load_loss_weight and not self.noisy_gating:
                raise ValueError(f"load_loss_weight={self.load_loss_weight} needs noisy_gating=True")

    def __init__(self, in_features: int, config: Config, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.num_groups = config.num_groups
        self.experts_per_group = config.num_experts // config.num_groups
        self.top_k_groups = config.top_k_groups
        self.top_k_per_group = config.top_k
        self.top_k = config.top_k_groups * config.top_k
        dd = {"device": device, "dtype": dtype}
        self.primary_weight = router_weight(self.num_groups, in_features, **dd)
        self.secondary_weight = router_weight(self.num_experts, in_features, **dd)
        if config.noisy_gating:
            self.primary_noise = nn.Parameter(torch.zeros(self.num_groups, in_features, **dd))
            self.secondary_noise = nn.Parameter(torch.zeros(self.num_experts, in_features, **dd))
        else:
            self.primary_noise = self.secondary_noise = None
        if config.router_init == "zeros":
            nn.init.zeros_(self.primary_weight)
            nn.init.zeros_(self.secondary_weight)

    def reset_parameters(self) -> None:
        zeros = self.config.router_init == "zeros"
        reset_own_parameters(self, ("primary_weight", "secondary_weight"), zeros=zeros)

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

    def forward(self, x: Tensor, token_ids: Tensor | None = None, mask: Tensor | None = None) -> Routing:
        num_tokens = x.shape[0]
        groups, per_group, k = self.num_groups, self.experts_per_group, self.top_k_per_group
        p_clean, p_noisy, p_std = self._noisy(x, self.primary_weight, self.primary_noise)
        group_ids, group_gates = self._keep_top_k_softmax(p_noisy, self.top_k_groups)  # [N, kg]
        s_clean, s_noisy, s_std = self._noisy(x, self.secondary_weight, self.secondary_noise)
        s_noisy = s_noisy.view(num_tokens, groups, per_group)
        local_ids, local_gates = self._keep_top_k_softmax(s_noisy, k)  # [N, G, k]
        # Keep the secondary choices of the chosen groups only.
        idx = group_ids.unsqueeze(-1).expand(-1, -1, k)
        chosen_local = local_ids.gather(1, idx)  # [N, kg, k]
        chosen_gates = local_gates.gather(1, idx) * group_gates.unsqueeze(-1)
        expert_ids = (group_ids.unsqueeze(-1) * per_group + chosen_local).reshape(num_tokens, -1)
        gates = chosen_gates.reshape(num_tokens, -1)
        order = gates.argsort(dim=-1, descending=True)  # best first, as other routers
        expert_ids, gates = expert_ids.gather(1, order), gates.gather(1, order)

        cfg = self.config
        losses: dict[str, Tensor] = {}
        if cfg.importance_loss_weight:
            dense = gates.new_zeros(num_tokens, self.num_experts).scatter(1, expert_ids, gates)
            losses["importance"] = cfg.importance_loss_weight * importance_loss(dense, mask)
        if cfg.load_loss_weight and p_std is not None:
            load_primary = smooth_load(p_clean, p_noisy, p_std, self.top_k_groups, mask)  # [G]
            in_group = torch.zeros(num_tokens, groups, device=x.device).scatter(1, group_ids, 1.0)  # X^(i) mask
            if mask is not None:  # padding is in no group's batch
                in_group = in_group * mask.unsqueeze(1)
            flat = (num_tokens * groups, per_group)  # every group's secondary gate as its own row
            per_token = load_probabilities(s_clean.reshape(flat), s_noisy.reshape(flat), s_std.reshape(flat), k).view(
                num_tokens, groups, per_group
            )
            load_secondary = (per_token * in_group.unsqueeze(-1)).sum(0)  # [G, per_group]
            group_size = in_group.sum(0).clamp_min(1.0)
            load_h = load_primary.unsqueeze(-1) * load_secondary / group_size.unsqueeze(-1)
            losses["load"] = cfg.load_loss_weight * cv_squared(load_h.reshape(-1))
        probs = expert_softmax(p_noisy).repeat_interleave(per_group, dim=1) * expert_softmax(s_noisy).reshape(
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
