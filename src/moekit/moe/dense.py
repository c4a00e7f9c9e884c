"""Dense soft mixture of experts: every expert processes every token, and the outputs are mixed
with softmax gates, ``y = sum_e softmax(x W^T)_e * expert_e(x)``.

This is the "continuous" MoE baseline (Jacobs et al. 1991 style): it pays ``E`` times the compute
of one expert and drops nothing; each token's output depends on that token only (causal).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .experts import Kernel
from .losses import router_z_loss
from .routers import logit_checksum, router_logits, router_weight
from .stats import dense_mixture_stats

__all__ = ["DenseMoE"]


@register_moe_layer("dense")
class DenseMoE(MoELayer):
    """Dense soft mixture of ``num_experts`` experts, a drop-in replacement for timm's ``Mlp``."""

    def __init__(
        self,
        in_features: int,
        hidden_features: int | None = None,
        out_features: int | None = None,
        act_layer=nn.GELU,
        norm_layer=None,
        bias=True,
        drop=0.0,
        use_conv: bool = False,
        *,
        num_experts: int = 4,
        z_loss_weight: float = 0.0,
        expert_hidden_features: int | None = None,
        gated: bool = False,
        expert_init: str = "independent",
        expert_init_std: float | None = None,
        kernel: Kernel = "auto",
        compute_stats: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(compute_stats)
        spec = MlpSpec.from_mlp_kwargs(
            in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv, "DenseMoE"
        )
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"DenseMoE: num_experts={num_experts!r} must be a positive int")
        self.in_features = spec.in_features
        self.out_features = spec.out_features
        self.num_experts = num_experts
        self.z_loss_weight = z_loss_weight
        self.router_weight = router_weight(num_experts, spec.in_features, device, dtype)
        self.experts = spec.expert_bank(
            num_experts,
            expert_hidden_features,
            gated=gated,
            init=expert_init,
            init_std=expert_init_std,
            kernel=kernel,
            device=device,
            dtype=dtype,
        )

    @property
    def causal_safe(self) -> bool:
        return True

    def expert_rows_per_token(self, num_tokens: int) -> float:
        return float(self.num_experts)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x, self.in_features, "DenseMoE")
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
