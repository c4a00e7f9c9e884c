"""Dense soft mixture of experts: every expert processes every token, and the outputs are mixed
with softmax gates, ``y = sum_e softmax(x W^T)_e * expert_e(x)``.

This is the "continuous" MoE (Jacobs et al. 1991; Eigen et al. 2013): it pays ``E`` times the compute of one
expert and drops nothing; each token's output depends on that token only (causal). The gate is one linear layer,
or with ``gate_hidden`` a two-layer network ``W_2 relu(W_1 x + b_1) + b_2`` (Eigen et al.'s gating network), and
``overpower_margin`` drops experts that run ahead in training (:mod:`moekit.moe.expert_dropping`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .expert_dropping import OverpoweringExperts, check_margin
from .experts import ExpertsConfig
from .losses import router_z_loss
from .routing import (
    expert_softmax,
    logit_checksum,
    reset_own_parameters,
    router_logits,
    router_precision,
    router_weight,
)
from .stats import dense_mixture_stats

__all__ = ["DenseMoE"]


@register_moe_layer("dense_moe")
class DenseMoE(MoELayer):
    """Dense soft mixture of ``num_experts`` experts (default 4), a drop-in replacement for timm's ``Mlp``.
    Settings: ``z_loss_weight`` (ST-MoE router z-loss, 0 = off), ``gate_hidden`` (the hidden width of a two-layer
    gating network; None: one linear layer), ``overpower_margin`` (Eigen et al.'s expert dropping; None: off) and
    :class:`~moekit.moe.experts.ExpertsConfig`."""

    @dataclass(kw_only=True)
    class Config:
        z_loss_weight: float = 0.0
        gate_hidden: int | None = None
        overpower_margin: float | None = None

        def __post_init__(self) -> None:
            if not self.z_loss_weight >= 0:
                raise ValueError(f"z_loss_weight={self.z_loss_weight!r} must be >= 0")
            hidden = self.gate_hidden
            if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
                raise ValueError(f"gate_hidden={hidden!r} must be a positive int (a two-layer gate) or null (linear)")
            check_margin(self.overpower_margin)

    configs = (Config, ExpertsConfig)
    defaults = {"num_experts": 4}

    def build(self, mlp: MlpSpec, config: Config, experts: ExpertsConfig, *, device=None, dtype=None) -> None:
        self.num_experts = experts.num_experts
        self.z_loss_weight = config.z_loss_weight
        if config.gate_hidden is None:
            self.gate_hidden_weight = self.gate_hidden_bias = self.router_bias = None
            self.router_weight = router_weight(self.num_experts, mlp.in_features, device, dtype)
        else:
            self.gate_hidden_weight = router_weight(config.gate_hidden, mlp.in_features, device, dtype)
            self.gate_hidden_bias = nn.Parameter(torch.zeros(config.gate_hidden, device=device, dtype=dtype))
            self.router_weight = router_weight(self.num_experts, config.gate_hidden, device, dtype)
            self.router_bias = nn.Parameter(torch.zeros(self.num_experts, device=device, dtype=dtype))
        self.overpowering = (
            None
            if config.overpower_margin is None
            else OverpoweringExperts(self.num_experts, config.overpower_margin, device=device)
        )
        self.experts = experts.build(mlp, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        reset_own_parameters(self, ("gate_hidden_weight", "router_weight"))

    def gate_logits(self, x_ND: Tensor) -> Tensor:
        """The gating network's logits ``[N, E]`` in float32 (float64 in a float64 layer)."""
        if self.gate_hidden_weight is None:
            return router_logits(x_ND, self.router_weight)
        hidden_NH = torch.relu(router_logits(x_ND, self.gate_hidden_weight) + router_precision(self.gate_hidden_bias))
        return router_logits(hidden_NH, self.router_weight) + router_precision(self.router_bias)

    @property
    def causal_safe(self) -> bool:
        return True

    def expert_rows_per_token(self, num_tokens: int) -> float:
        return float(self.num_experts)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``; ``padding_mask: [batch,
        tokens]`` bool, True for real tokens (padding gets a zero output)."""
        self._check_input(x)
        batch, tokens, dim = x.shape
        mask_N = self._token_mask(padding_mask, batch, tokens)
        x_flat = x.reshape(batch * tokens, dim)
        logits = self.gate_logits(x_flat)
        num_tokens = x_flat.shape[0]
        if self.overpowering is None or not self.training:
            gates = expert_softmax(logits)  # [N, E]
        else:  # Eigen et al.: the softmax over the experts that did not run ahead (renormalised gates that stay
            # finite where the kept experts' scores underflow next to a dropped expert's)
            gates = expert_softmax(self.overpowering.without_dropped(logits))
            real = num_tokens if mask_N is None else mask_N.sum()
            mass = gates.detach() if mask_N is None else gates.detach() * mask_N.unsqueeze(1)
            self.overpowering.received(mass.sum(dim=0), real)
        expert_in = x_flat.unsqueeze(0).expand(self.num_experts, -1, -1).reshape(-1, dim)
        expert_out = self.experts(expert_in, num_tokens).view(self.num_experts, num_tokens, -1)  # [E, N, o]
        mixed = gates if mask_N is None else gates * mask_N.unsqueeze(1)  # padding: no expert
        out = torch.einsum("ne,eno->no", mixed.to(expert_out.dtype), expert_out)
        losses = {"z": self.z_loss_weight * router_z_loss(logits, mask_N)} if self.z_loss_weight else {}
        gates = gates.detach()
        self._record(losses, lambda: dense_mixture_stats(gates, mask_N), num_tokens, logit_checksum(logits))
        return out.view(batch, tokens, -1)
