"""Soft MoE (Puigcerver et al., "From Sparse to Soft Mixtures of Experts", ICLR 2024).

For one sequence ``X: [m, d]`` with ``n`` experts of ``p`` slots each (``S = n * p`` slots)::

    logits   = l2norm(X, over d) @ (scale * l2norm(Phi, over d))     # [m, S], Phi: [d, S], scale init 1
    D        = softmax(logits, over tokens m)                        # dispatch: each column sums to 1
    C        = softmax(logits, over slots S)                         # combine: each row sums to 1
    X_slots  = D^T @ X                                               # [S, d], from the un-normalised X
    Y_slots  = expert_{floor(i / p)}(X_slots[i])  for every slot i   # [S, o]
    Y        = C @ Y_slots                                           # [m, o]

Every token reaches every slot with a non-zero weight: nothing is dropped, and the layer is
equivariant to permutations of the tokens. Logits and both softmaxes run in float32 under autocast;
the three matmuls over tokens run in the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .experts import Kernel
from .routers import logit_checksum, router_precision
from .stats import soft_moe_stats

__all__ = ["SoftMoE"]


@register_moe_layer("soft_moe")
class SoftMoE(MoELayer):
    """Soft MoE layer, a drop-in replacement for timm's ``Mlp``.

    Args:
        in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv,
            device, dtype: as timm ``Mlp``; ``hidden_features`` is each expert's hidden size.
        num_experts: ``n``.
        slots_per_expert: ``p``; give this or ``capacity_factor``.
        capacity_factor: sets ``p = round(num_tokens * capacity_factor / num_experts)`` (the paper's
            "capacity factor"; 1.0 gives as many slots as tokens). Needs ``num_tokens``.
        num_tokens: tokens per sequence ``m`` the slot count is sized for (with ``capacity_factor``).
        normalize: l2-normalise ``X`` and ``Phi`` with a learned scale (the paper's recipe for
            large widths); False gives plain ``X @ Phi``.
        noise_std: std of Gaussian noise added to the logits in training (0 = off).
        gated: SwiGLU-style experts (see :class:`ExpertBank`).
        expert_init, expert_init_std, kernel: passed to :class:`ExpertBank`.
        compute_stats: record routing statistics each forward.

    ``forward(x, padding_mask=None)``: ``x: [batch, tokens, in_features]``; ``padding_mask: [batch,
    tokens]`` bool, True for real tokens: padding tokens are left out of every slot and get zero output.
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
        num_experts: int = 128,
        slots_per_expert: int | None = None,
        capacity_factor: float | None = None,
        num_tokens: int | None = None,
        normalize: bool = True,
        noise_std: float = 0.0,
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
            in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv, "SoftMoE"
        )
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"SoftMoE: num_experts={num_experts!r} must be a positive int")
        self.slots_per_expert = self._resolve_slots(num_experts, slots_per_expert, capacity_factor, num_tokens)
        if noise_std < 0:
            raise ValueError(f"SoftMoE: noise_std={noise_std!r} must be >= 0")
        self.in_features = spec.in_features
        self.out_features = spec.out_features
        self.num_experts = num_experts
        self.num_slots = num_experts * self.slots_per_expert
        self.normalize = normalize
        self.noise_std = noise_std
        dd = {"device": device, "dtype": dtype}
        # Phi: one d-dimensional parameter vector per slot (LeCun-normal, as vmoe).
        self.phi = nn.Parameter(torch.randn(spec.in_features, self.num_slots, **dd) / math.sqrt(spec.in_features))
        # The learned scale of the normalised logits, shape [1] (FSDP shards no 0-d parameters).
        self.scale = nn.Parameter(torch.ones(1, **dd)) if normalize else None
        self.experts = spec.expert_bank(
            num_experts,
            gated=gated,
            init=expert_init,
            init_std=expert_init_std,
            kernel=kernel,
            **dd,
        )

    @staticmethod
    def _resolve_slots(num_experts, slots_per_expert, capacity_factor, num_tokens) -> int:
        if slots_per_expert is not None and capacity_factor is not None:
            raise ValueError(
                f"SoftMoE: give slots_per_expert ({slots_per_expert}) or capacity_factor ({capacity_factor}), not both"
            )
        if capacity_factor is not None:
            if not capacity_factor > 0:
                raise ValueError(f"SoftMoE: capacity_factor={capacity_factor!r} must be > 0")
            if not isinstance(num_tokens, int) or num_tokens < 1:
                raise ValueError(
                    f"SoftMoE: capacity_factor={capacity_factor} needs num_tokens (tokens per sequence), "
                    f"got num_tokens={num_tokens!r}"
                )
            slots = round(num_tokens * capacity_factor / num_experts)
            if slots < 1:
                raise ValueError(
                    f"SoftMoE: capacity_factor={capacity_factor} with num_tokens={num_tokens} and "
                    f"num_experts={num_experts} gives round({num_tokens}*{capacity_factor}/{num_experts}) = 0 slots "
                    f"per expert; raise capacity_factor to at least {num_experts / (2 * num_tokens):.3g} "
                    "or use fewer experts"
                )
            return slots
        slots = 1 if slots_per_expert is None else slots_per_expert
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"SoftMoE: slots_per_expert={slots_per_expert!r} must be a positive int")
        return slots

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        scale = state_dict.get(prefix + "scale")
        if scale is not None and scale.dim() == 0:  # checkpoints from before the scale became [1]
            state_dict[prefix + "scale"] = scale.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def compute_logits(self, x: Tensor) -> Tensor:
        """``[B, M, d] -> [B, M, S]`` routing logits in float32 (noise not included)."""
        with torch.autocast(x.device.type, enabled=False):
            x = router_precision(x)
            phi = self.phi.to(x.dtype)
            if self.normalize:
                x = F.normalize(x, dim=-1)
                phi = self.scale.to(x.dtype) * F.normalize(phi, dim=0)
            return torch.matmul(x, phi)

    def routing_weights(self, x: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Dispatch and combine weights ``D, C: [B, M, S]`` (float32) for ``x: [B, M, d]``.

        ``D`` is a softmax over tokens (each slot's column sums to 1 over real tokens), ``C`` a softmax
        over slots (each real token's row sums to 1; padding rows are 0). Noise is added in training.
        """
        dispatch, combine, _ = self._routing(x, padding_mask)
        return dispatch, combine

    def _routing(self, x: Tensor, padding_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`routing_weights` and the :func:`logit_checksum` of the logits (before padding is masked)."""
        batch, tokens, _ = x.shape
        logits = self.compute_logits(x)
        if self.training and self.noise_std > 0:
            logits = logits + self.noise_std * torch.randn_like(logits)
        checksum = logit_checksum(logits)
        if padding_mask is not None:
            if padding_mask.shape != (batch, tokens):
                raise ValueError(
                    f"SoftMoE: padding_mask of shape {tuple(padding_mask.shape)} - expected [batch, tokens] = "
                    f"{[batch, tokens]} (bool, True for real tokens)"
                )
            # Padding tokens get no dispatch weight; a fully padded row still gives finite weights.
            logits = logits.masked_fill(~padding_mask.unsqueeze(-1), torch.finfo(logits.dtype).min)
        dispatch = torch.softmax(logits, dim=1)  # over tokens, per slot
        combine = torch.softmax(logits, dim=2)  # over slots, per token
        if padding_mask is not None:
            combine = combine * padding_mask.unsqueeze(-1)
        return dispatch, combine, checksum

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``."""
        self._check_input(x, self.in_features, "SoftMoE")
        batch = x.shape[0]
        dispatch, combine, checksum = self._routing(x, padding_mask)

        compute_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        slots = torch.bmm(dispatch.transpose(1, 2).to(compute_dtype), x.to(compute_dtype))  # [B, S, d]
        # Slot i goes to expert i // p: regroup [B, n, p, d] -> [n, B * p, d] rows sorted by expert.
        p = self.slots_per_expert
        expert_in = slots.view(batch, self.num_experts, p, -1).transpose(0, 1).reshape(-1, slots.shape[-1])
        expert_out = self.experts(expert_in, batch * p)
        slot_out = expert_out.view(self.num_experts, batch, p, -1).transpose(0, 1).reshape(batch, self.num_slots, -1)
        out = torch.bmm(combine.to(slot_out.dtype), slot_out)  # [B, M, o]

        dispatch, combine = dispatch.detach(), combine.detach()
        self._record(
            {},
            lambda: soft_moe_stats(dispatch, combine, self.num_experts, padding_mask),
            batch * x.shape[1],
            checksum,
        )
        return out

    def expert_rows_per_token(self, num_tokens: int) -> float:
        return self.num_slots / num_tokens

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, normalize={self.normalize}, "
            f"noise_std={self.noise_std}"
        )
