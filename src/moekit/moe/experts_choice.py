"""Experts-choice routing (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing").

Router probabilities ``P = softmax(x W^T)`` over experts, ``[N, E]``. Instead of tokens picking
experts, each expert picks the ``C = R(N * capacity_factor / E)`` tokens with the highest ``P[:, e]``
(:mod:`moekit.moe.capacity`):
every expert processes exactly ``C`` tokens (perfect load balance by construction), a token may be
picked by several experts or by none (it then passes through on the residual). The output of token
``n`` is ``sum over experts e that picked n of P[n, e] * expert_e(x_n)``.

Which tokens an expert picks depends on all tokens of the forward, so the layer is not causal. Padding
(``padding_mask`` False) is never picked and does not count in ``N``: each expert takes ``C`` of the real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .base import MlpSpec, MoELayer, register_moe_layer
from .capacity import check_factor, experts_choice_capacity
from .experts import ExpertsConfig
from .losses import router_z_loss
from .routing import (
    check_loss_weights,
    count_ids,
    expert_softmax,
    logit_checksum,
    reset_own_parameters,
    router_logits,
    router_weight,
)
from .stats import experts_choice_stats

__all__ = ["ExpertsChoiceMoE"]


@register_moe_layer("experts_choice")
class ExpertsChoiceMoE(MoELayer):
    """Experts-choice MoE, a drop-in replacement for timm's ``Mlp``. Settings: :class:`ExpertsChoiceMoE.Config`
    and :class:`~moekit.moe.experts.ExpertsConfig` (``num_experts`` ``E``)."""

    @dataclass(kw_only=True)
    class Config:
        """Attributes:
        capacity_factor: ``c``, the average number of experts per token; each expert takes
            ``C = R(tokens * c / E)`` tokens of the forward (all ``batch * tokens`` together;
            :func:`~moekit.moe.capacity.experts_choice_capacity`).
        eval_capacity_factor: the same in eval mode (``"same"``: ``capacity_factor``).
        group_size: experts choose within each group of this many consecutive tokens of the flattened
            ``batch * tokens`` (``C = R(group_size * c / E)`` from each; V-MoE routes within groups); None = all
            tokens of the forward together.
        z_loss_weight: ST-MoE router z-loss weight (0 = off).
        """

        capacity_factor: float = 1.0
        eval_capacity_factor: float | Literal["same"] = "same"
        group_size: int | None = None
        z_loss_weight: float = 0.0

        def __post_init__(self) -> None:
            if self.eval_capacity_factor == "same":
                self.eval_capacity_factor = self.capacity_factor
            check_factor(self.capacity_factor, "capacity_factor")
            check_factor(self.eval_capacity_factor, "eval_capacity_factor")
            check_loss_weights(z_loss_weight=self.z_loss_weight)
            size = self.group_size
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"group_size={size!r} must be a positive int (tokens per group) or null (all)")

    configs = (Config, ExpertsConfig)

    def build(self, mlp: MlpSpec, config: Config, experts: ExpertsConfig, *, device=None, dtype=None) -> None:
        self.num_experts = experts.num_experts
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(config, name)
            if value > self.num_experts:
                raise ValueError(
                    f"ExpertsChoiceMoE: {name}={value!r} must be at most num_experts={self.num_experts} "
                    "(the average number of experts per token)"
                )
        self.capacity_factor = float(config.capacity_factor)
        self.eval_capacity_factor = float(config.eval_capacity_factor)
        self.z_loss_weight = config.z_loss_weight
        self.group_size = config.group_size
        self.router_weight = router_weight(self.num_experts, mlp.in_features, device, dtype)
        self.experts = experts.build(mlp, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        reset_own_parameters(self, ("router_weight",))

    def tokens_per_expert(self, num_tokens: int) -> int:
        """The tokens each expert takes from ``num_tokens`` in the current mode (``C`` from each group)."""
        size = self.group_size or num_tokens
        return self._capacity_per_group(size) * (num_tokens // size)

    def _capacity_per_group(self, size: int) -> int:
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return experts_choice_capacity(size, self.num_experts, factor)

    def route(self, x: Tensor, mask_N: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Route ``x: [N, d]``. Returns ``(token_idx [E, C], gates [E, C], probs [N, E], logits [N, E])``:
        expert ``e`` processes tokens ``token_idx[e]`` with weights ``gates[e] = probs[token_idx[e], e]``.

        With ``mask_N: [N]`` (False for padding) ``C`` stays the capacity of whole groups, so the shapes are static,
        and each expert fills ``R(n * c / E)`` slots of a group with ``n`` real tokens: the other slots get gate 0."""
        logits = router_logits(x, self.router_weight)
        probs = expert_softmax(logits)
        num_tokens, size = x.shape[0], self.group_size or x.shape[0]
        if num_tokens % size:
            raise ValueError(
                f"ExpertsChoiceMoE: {num_tokens} tokens (batch x tokens) are not whole groups of group_size={size}; "
                "choose a group_size that divides them (e.g. the tokens of one image)"
            )
        groups, per_group = num_tokens // size, self._capacity_per_group(size)
        scores_NE = probs if mask_N is None else torch.where(mask_N.unsqueeze(1), probs, -1.0)  # padding last
        gates_EGC, idx_EGC = scores_NE.t().reshape(self.num_experts, groups, size).topk(per_group, dim=-1)
        if mask_N is not None:
            factor = self.capacity_factor if self.training else self.eval_capacity_factor
            filled_G1 = experts_choice_capacity(mask_N.view(groups, size).sum(dim=1), self.num_experts, factor)
            in_capacity_GC = torch.arange(per_group, device=x.device) < filled_G1.unsqueeze(1)
            gates_EGC = torch.where(in_capacity_GC & (gates_EGC >= 0), gates_EGC, 0.0)
        offsets_G1 = torch.arange(groups, device=x.device).unsqueeze(1) * size
        token_idx = (idx_EGC + offsets_G1).reshape(self.num_experts, -1)  # [E, groups * C]
        return token_idx, gates_EGC.reshape(self.num_experts, -1), probs, logits

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``; ``padding_mask: [batch,
        tokens]`` bool, True for real tokens."""
        self._check_input(x)
        batch, tokens, dim = x.shape
        mask_N = self._token_mask(padding_mask, batch, tokens)
        x_flat = x.reshape(batch * tokens, dim)
        token_idx, gates, probs, logits = self.route(x_flat, mask_N)
        flat_idx = token_idx.reshape(-1)
        expert_out = self.experts(x_flat.index_select(0, flat_idx), token_idx.shape[1])  # [E * C, o]
        weighted = expert_out * gates.reshape(-1, 1).to(expert_out.dtype)
        out = weighted.new_zeros(x_flat.shape[0], weighted.shape[-1]).index_add_(0, flat_idx, weighted)

        losses = {"z": self.z_loss_weight * router_z_loss(logits, mask_N)} if self.z_loss_weight else {}
        num_tokens = x_flat.shape[0]
        probs, gates = probs.detach(), gates.detach()
        # the slots holding a token: all, or under a mask those with a gate (a softmax gate is positive)
        held_idx = flat_idx if mask_N is None else torch.where(gates.reshape(-1) > 0, flat_idx, num_tokens)
        self._record(
            losses,
            lambda: experts_choice_stats(probs, count_ids(held_idx, num_tokens + 1)[:num_tokens], gates, mask_N),
            num_tokens,
            logit_checksum(logits),
            lambda: torch.zeros_like(probs).index_put_(  # [N, E]: 1 where expert e took token n
                (token_idx, torch.arange(self.num_experts, device=x.device)[:, None].expand_as(token_idx)),
                torch.ones_like(gates) if mask_N is None else (gates > 0).float(),
                accumulate=True,
            ),
        )
        return out.view(batch, tokens, -1)

    def expert_rows_per_token(self, num_tokens: int) -> float:
        # per group: its C tokens for each expert over its size (a group may span sequences of num_tokens tokens)
        size = self.group_size or num_tokens
        return self._capacity_per_group(size) * self.num_experts / size

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, capacity_factor={self.capacity_factor}, "
            f"eval_capacity_factor={self.eval_capacity_factor}"
        )
