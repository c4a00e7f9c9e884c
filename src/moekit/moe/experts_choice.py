"""Experts-choice routing (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing").

Router probabilities ``P = softmax(x W^T)`` over experts, ``[N, E]``. Instead of tokens picking
experts, each expert picks the ``C = round(N * capacity_factor / E)`` tokens with the highest ``P[:, e]``:
every expert processes exactly ``C`` tokens (perfect load balance by construction), a token may be
picked by several experts or by none (it then passes through on the residual). The output of token
``n`` is ``sum over experts e that picked n of P[n, e] * expert_e(x_n)``.

Which tokens an expert picks depends on all tokens of the forward, so the layer is not causal.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .experts import Kernel
from .losses import router_z_loss
from .routers import logit_checksum, router_logits, router_weight
from .stats import experts_choice_stats

__all__ = ["ExpertsChoiceMoE"]


@register_moe_layer("experts_choice")
class ExpertsChoiceMoE(MoELayer):
    """Experts-choice MoE, a drop-in replacement for timm's ``Mlp``.

    Args:
        num_experts: ``E``.
        capacity_factor: ``c``, the average number of experts per token; each expert takes
            ``C = round(tokens * c / E)`` tokens of the forward (all ``batch * tokens`` together).
        eval_capacity_factor: the same in eval mode (``"same"``: ``capacity_factor``).
        z_loss_weight: ST-MoE router z-loss weight (0 = off).
        Other keywords as :class:`~moekit.moe.token_choice.TokenChoiceMoE` and timm ``Mlp``.
    """

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
        num_experts: int = 8,
        capacity_factor: float = 1.0,
        eval_capacity_factor="same",
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
            in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv, "ExpertsChoiceMoE"
        )
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"ExpertsChoiceMoE: num_experts={num_experts!r} must be a positive int")
        eval_capacity_factor = capacity_factor if eval_capacity_factor == "same" else eval_capacity_factor
        for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
            if not (isinstance(value, (int, float)) and 0 < value <= num_experts):
                raise ValueError(
                    f"ExpertsChoiceMoE: {name}={value!r} must be in (0, num_experts={num_experts}] "
                    "(the average number of experts per token)"
                )
        if z_loss_weight < 0:
            raise ValueError(f"ExpertsChoiceMoE: z_loss_weight={z_loss_weight!r} must be >= 0")
        self.in_features = spec.in_features
        self.out_features = spec.out_features
        self.num_experts = num_experts
        self.capacity_factor = float(capacity_factor)
        self.eval_capacity_factor = float(eval_capacity_factor)
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

    def tokens_per_expert(self, num_tokens: int) -> int:
        """``C = round(num_tokens * capacity_factor / E)`` for the current mode, at least 1."""
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return min(num_tokens, max(1, round(num_tokens * factor / self.num_experts)))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Route ``x: [N, d]``. Returns ``(token_idx [E, C], gates [E, C], probs [N, E], logits [N, E])``:
        expert ``e`` processes tokens ``token_idx[e]`` with weights ``gates[e] = probs[token_idx[e], e]``."""
        logits = router_logits(x, self.router_weight)
        probs = torch.softmax(logits, dim=-1)
        gates, token_idx = probs.t().topk(self.tokens_per_expert(x.shape[0]), dim=-1)
        return token_idx, gates, probs, logits

    def forward(self, x: Tensor) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``."""
        self._check_input(x, self.in_features, "ExpertsChoiceMoE")
        batch, tokens, dim = x.shape
        x_flat = x.reshape(batch * tokens, dim)
        token_idx, gates, probs, logits = self.route(x_flat)
        flat_idx = token_idx.reshape(-1)
        expert_out = self.experts(x_flat.index_select(0, flat_idx), token_idx.shape[1])  # [E * C, o]
        weighted = expert_out * gates.reshape(-1, 1).to(expert_out.dtype)
        out = weighted.new_zeros(x_flat.shape[0], weighted.shape[-1]).index_add_(0, flat_idx, weighted)

        losses = {"z": self.z_loss_weight * router_z_loss(logits)} if self.z_loss_weight else {}
        num_tokens = x_flat.shape[0]
        probs, gates = probs.detach(), gates.detach()
        self._record(
            losses,
            lambda: experts_choice_stats(probs, torch.bincount(flat_idx, minlength=num_tokens), gates),
            num_tokens,
            logit_checksum(logits),
        )
        return out.view(batch, tokens, -1)

    def expert_rows_per_token(self, num_tokens: int) -> float:
        return self.tokens_per_expert(num_tokens) * self.num_experts / num_tokens

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, capacity_factor={self.capacity_factor}, "
            f"eval_capacity_factor={self.eval_capacity_factor}"
        )
