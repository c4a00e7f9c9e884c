"""Soft MoE (Puigcerver et al., "From Sparse to Soft Mixtures of Experts", ICLR 2024).

For one sequence ``X: [m, d]`` with ``n`` experts of ``p`` slots each (``S = n * p`` slots)::

    logits   = l2norm(X, over d) @ (scale * l2norm(Phi, over d))     # [m, S], Phi: [d, S], scale init 1
    D        = softmax(logits, over tokens m)                        # dispatch_weights: each column sums to 1
    C        = softmax(logits, over slots S)                         # combine_weights: each row sums to 1
    X_slots  = D^T @ X                                               # [S, d], from the un-normalised X
    Y_slots  = expert_{floor(i / p)}(X_slots[i])  for every slot i   # [S, o]
    Y        = C @ Y_slots                                           # [m, o]

Every token reaches every slot with a non-zero weight: nothing is dropped, and the layer is
equivariant to permutations of the tokens. Logits and both softmaxes run in float32 under autocast;
the dispatch and combine products (``D^T X``, ``C Y_slots``) and the experts run in the compute dtype.

Shapes: ``B`` batch, ``M`` tokens per sequence, ``S`` slots, ``D`` width, ``O`` output width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .capacity import check_factor, soft_moe_slots
from .cpu_matmul import linear
from .experts import ExpertsConfig, compute_dtype
from .routing import logit_checksum, router_precision
from .stats import soft_moe_stats

__all__ = ["SoftMoE", "dispatch_weights", "combine_weights"]

_NORM_EPS = 1e-12  # F.normalize's


def dispatch_weights(logits_BMS: Tensor, mask_BM: Tensor | None = None) -> Tensor:
    """``D = softmax(logits)`` over the tokens of each sequence, per slot: a slot's input is the
    ``D``-weighted average of the tokens. Padding tokens (``mask`` False) get weight 0; a fully padded
    sequence still gives finite weights."""
    if mask_BM is not None:
        logits_BMS = logits_BMS.masked_fill(~mask_BM.unsqueeze(-1), torch.finfo(logits_BMS.dtype).min)
    return torch.softmax(logits_BMS, dim=1)


def combine_weights(logits_BMS: Tensor, mask_BM: Tensor | None = None) -> Tensor:
    """``C = softmax(logits)`` over the slots, per token: a token's output is the ``C``-weighted average of
    the slot outputs. Rows of padding tokens (``mask`` False) are 0."""
    combine_BMS = torch.softmax(logits_BMS, dim=2)
    return combine_BMS if mask_BM is None else combine_BMS * mask_BM.unsqueeze(-1)


class _NormalizedLogits(torch.autograd.Function):
    """``l2norm(X) @ Phi = (X @ Phi) / |X|`` for ``X: [N, D]`` (``F.normalize``'s eps as the floor of ``|X|``): the
    division runs over a token's ``S`` logits, not its ``D`` features, and no normalised copy of ``X`` is kept.

    Backward, with ``G = dL/dlogits`` and ``R = G / |X|`` (the gradient of ``X @ Phi``)::

        dPhi = X^T @ R                                     # [D, S]
        dX   = R @ Phi^T - X * sum_s(R * logits) / |X|     # [N, D]; |X|'s share 0 where eps floors it

    one pass over ``[N, D]`` after the product, where autograd's backward of the norm and the division took four.
    """

    @staticmethod
    def forward(ctx, x_ND: Tensor, phi_DS: Tensor) -> Tensor:
        norm_N1 = torch.linalg.vector_norm(x_ND, dim=-1, keepdim=True)
        logits_NS = linear(x_ND, phi_DS.t()).div_(norm_N1.clamp_min(_NORM_EPS))
        ctx.save_for_backward(x_ND, phi_DS, norm_N1, logits_NS)
        return logits_NS

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NS: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x_ND, phi_DS, norm_N1, logits_NS = ctx.saved_tensors
        denom_N1 = norm_N1.clamp_min(_NORM_EPS)
        grad_raw_NS = grad_NS / denom_N1
        grad_x = grad_phi = None
        if ctx.needs_input_grad[0]:
            share_N1 = (grad_raw_NS * logits_NS).sum(-1, keepdim=True).div_(denom_N1)
            share_N1.masked_fill_(norm_N1 < _NORM_EPS, 0)
            grad_x = linear(grad_raw_NS, phi_DS).addcmul_(x_ND, share_N1, value=-1)
        if ctx.needs_input_grad[1]:
            grad_phi = linear(x_ND.t(), grad_raw_NS.t())  # X^T @ R
        return grad_x, grad_phi


@register_moe_layer("soft_moe")
class SoftMoE(MoELayer):
    """Soft MoE layer, a drop-in replacement for timm's ``Mlp`` (``hidden_features``: each expert's hidden
    size). Settings: :class:`SoftMoE.Config` and :class:`~moekit.moe.experts.ExpertsConfig`
    (``num_experts`` ``n``, default 128).

    ``forward(x, padding_mask=None)``: ``x: [batch, tokens, in_features]``; ``padding_mask: [batch,
    tokens]`` bool, True for real tokens: padding tokens are left out of every slot and get zero output.
    """

    @dataclass(kw_only=True)
    class Config:
        """Slots and logits of a Soft MoE layer.

        Attributes:
            slots_per_expert: ``p``; or give ``capacity_factor`` (neither: 1 slot per expert).
            capacity_factor: slots per token: ``p = R(num_tokens * capacity_factor / n)``
                (:func:`~moekit.moe.capacity.soft_moe_slots`); needs ``num_tokens``.
            num_tokens: tokens per sequence ``m`` the slots are sized for (a ViT sets it).
            normalize: l2-normalise ``X`` and ``Phi`` with a learned scale (the paper's recipe for large
                widths); False gives plain ``X @ Phi``.
            noise_std: std of Gaussian noise added to the logits in training (0 = off).
        """

        slots_per_expert: int | None = None
        capacity_factor: float | None = None
        num_tokens: int | None = None
        normalize: bool = True
        noise_std: float = 0.0

        def __post_init__(self) -> None:
            if self.slots_per_expert is not None and self.capacity_factor is not None:
                raise ValueError(
                    f"give slots_per_expert ({self.slots_per_expert}) or capacity_factor ({self.capacity_factor}), "
                    "not both (set the other to null)"
                )
            check_factor(self.capacity_factor, "capacity_factor", optional=True)
            if self.capacity_factor is not None and (
                isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1
            ):
                raise ValueError(
                    f"capacity_factor={self.capacity_factor} needs num_tokens (tokens per sequence), "
                    f"got num_tokens={self.num_tokens!r}"
                )
            slots = self.slots_per_expert
            if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
                raise ValueError(f"slots_per_expert={slots!r} must be a positive int")
            noise = self.noise_std
            if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise < math.inf:
                raise ValueError(f"noise_std={noise!r} must be a finite number >= 0 (0 turns it off)")
            if not isinstance(self.normalize, bool):
                raise ValueError(f"normalize={self.normalize!r} must be true or false (l2-normalised logits)")

        def slots(self, num_experts: int) -> int:
            """Slots per expert ``p``."""
            if self.capacity_factor is not None:
                return soft_moe_slots(self.num_tokens, num_experts, self.capacity_factor)
            return self.slots_per_expert or 1

    configs = (Config, ExpertsConfig)
    defaults = {"num_experts": 128}

    def build(self, mlp: MlpSpec, config: Config, experts: ExpertsConfig, *, device=None, dtype=None) -> None:
        self.num_experts = experts.num_experts
        self.slots_per_expert = config.slots(self.num_experts)
        self.num_slots = self.num_experts * self.slots_per_expert
        self.normalize = config.normalize
        self.noise_std = config.noise_std
        dd = {"device": device, "dtype": dtype}
        # Phi: one d-dimensional parameter vector per slot (LeCun-normal, as vmoe).
        self.phi = nn.Parameter(torch.empty(mlp.in_features, self.num_slots, **dd))
        # The learned scale of the normalised logits, shape [1] (FSDP shards no 0-d parameters).
        self.scale = nn.Parameter(torch.empty(1, **dd)) if config.normalize else None
        self.reset_parameters()
        self.experts = experts.build(mlp, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Phi LeCun-normal, the scale 1 (also for a layer built on the meta device and materialised with
        ``to_empty``)."""
        self.phi.copy_(torch.randn_like(self.phi) / math.sqrt(self.phi.shape[0]))
        if self.scale is not None:
            self.scale.fill_(1.0)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        scale = state_dict.get(prefix + "scale")
        if scale is not None and scale.dim() == 0:  # checkpoints from before the scale became [1]
            state_dict[prefix + "scale"] = scale.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def compute_logits(self, x_BMD: Tensor) -> Tensor:
        """``[B, M, D] -> [B, M, S]`` routing logits in float32 (noise not included)."""
        with torch.autocast(x_BMD.device.type, enabled=False):
            x_BMD = router_precision(x_BMD)
            phi_DS = self.phi.to(x_BMD.dtype)
            if not self.normalize:
                return linear(x_BMD, phi_DS.t())  # x @ Phi
            phi_DS = self.scale.to(x_BMD.dtype) * F.normalize(phi_DS, dim=0)
            logits_NS = _NormalizedLogits.apply(x_BMD.reshape(-1, x_BMD.shape[-1]), phi_DS)
            return logits_NS.view(*x_BMD.shape[:-1], -1)

    def routing_weights(self, x: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Dispatch and combine weights ``D, C: [B, M, S]`` (float32) for ``x: [B, M, D]``, noise included in
        training (:func:`dispatch_weights`, :func:`combine_weights`)."""
        dispatch, combine, _ = self._routing(x, padding_mask)
        return dispatch, combine

    def _routing(self, x: Tensor, padding_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`routing_weights` and the :func:`logit_checksum` of the logits (before padding is masked)."""
        batch, tokens, _ = x.shape
        logits_BMS = self.compute_logits(x)
        if self.training and self.noise_std > 0:
            logits_BMS = logits_BMS + self.noise_std * torch.randn_like(logits_BMS)
        self._token_mask(padding_mask, batch, tokens)  # a bool [batch, tokens] mask, or a message naming it
        checksum = logit_checksum(logits_BMS)
        return dispatch_weights(logits_BMS, padding_mask), combine_weights(logits_BMS, padding_mask), checksum

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``."""
        self._check_input(x)
        B, M, D = x.shape
        dispatch_BMS, combine_BMS, checksum = self._routing(x, padding_mask)

        dtype = compute_dtype(x)
        slots_BSD = torch.bmm(dispatch_BMS.transpose(1, 2).to(dtype), x.to(dtype))
        # Slot i goes to expert i // p: regroup [B, n, p, D] -> [n, B * p, D] rows sorted by expert.
        n, p = self.num_experts, self.slots_per_expert
        expert_in = slots_BSD.view(B, n, p, D).transpose(0, 1).reshape(n * B * p, D)
        expert_out = self.experts(expert_in, B * p)
        slot_out_BSO = expert_out.view(n, B, p, -1).transpose(0, 1).reshape(B, self.num_slots, -1)
        out_BMO = torch.bmm(combine_BMS.to(slot_out_BSO.dtype), slot_out_BSO)

        dispatch_BMS, combine_BMS = dispatch_BMS.detach(), combine_BMS.detach()
        self._record(
            {},
            lambda: soft_moe_stats(dispatch_BMS, combine_BMS, self.num_experts, padding_mask),
            B * M,
            checksum,
            lambda: dispatch_BMS.float().view(B, M, self.num_experts, -1).sum(-1).reshape(B * M, -1),  # [N, E]
        )
        return out_BMO

    def expert_rows_per_token(self, num_tokens: int) -> float:
        return self.num_slots / num_tokens

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, normalize={self.normalize}, "
            f"noise_std={self.noise_std}"
        )
