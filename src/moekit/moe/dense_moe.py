"""Dense soft mixture of experts: every expert processes every token, and the outputs are mixed
with softmax gates, ``y = sum_e softmax(x W^T)_e * expert_e(x)``.

This is the "continuous" MoE baseline (Jacobs et al. 1991 style): it pays ``E`` times the compute
of one expert and drops nothing; each token's output depends on that token only (causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import MlpSpec, MoELayer, register_moe_layer
from .experts import ExpertsConfig
from .losses import router_z_loss
from .routing import logit_checksum, router_logits, router_weight
from .stats import dense_mixture_stats

__all__ = ["DenseMoE"]


@register_moe_layer("dense_moe")
class DenseMoE(MoELayer):
    """Dense soft mixture of ``num_experts`` experts (default 4), a drop-in replacement for timm's ``Mlp``.
    Settings: ``z_loss_weight`` (ST-MoE router z-loss, 0 = off) and :class:`~moekit.moe.experts.ExpertsConfig`."""

    @dataclass(kw_only=True)
    class Config:
        z_loss_weight: float = 0.0

        def __post_init__(self) -> None:
            if not self.z_loss_weight >= 0:
                raise ValueError(f"z_loss_weight={self.z_loss_weight!r} must be >= 0")

    configs = (Config, ExpertsConfig)
    defaults = {"num_experts": 4}

    def build(self, mlp: MlpSpec, config: Config, experts: ExpertsConfig, *, device=None, dtype=None) -> None:
        self.num_experts = experts.num_experts
        self.z_loss_weight = config.z_loss_weight
        self.router_weight = router_weight(self.num_experts, mlp.in_features, device, dtype)
        self.experts = experts.build(mlp, device=device, dtype=dtype)

    @property
    def causal_safe(self) -> bool:
        return True

    def expert_rows_per_token(self, num_tokens: int) -> float:
        return float(self.num_experts)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        batch, tokens, dim = x.shape
        x_flat = x.reshape(batch * tokens, dim)
        logits = router_logits(x_flat, self.router_weight)
        gates = torch.softmax(logits, dim=-1)  # [N, E]
        num_tokens = x_flat.shape[0]
        expert_in = x_flat.unsqueeze(0).expand(self.num_experts, -1, -1).reshape(-1, dim)
        expert_out = self.experts(expert_in, num_tokens).view(self.num_experts, num_tokens, -1)  # [E, N, o]
        out = torch.einsum("ne,eno->no", gates.to(expert_out.dtype), expert_out)
        losses = {"z": self.z_loss_weight * router_z_loss(logits)} if self.z_loss_weight else {}
        gates = gates.detach()
        self._record(losses, lambda: dense_mixture_stats(gates), num_tokens, logit_checksum(logits))
        return out.view(batch, tokens, -1)
