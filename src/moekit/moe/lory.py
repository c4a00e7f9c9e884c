"""Lory (Zhong et al. 2024, "Lory: Fully Differentiable Mixture-of-Experts for Autoregressive Language Model
Pre-training"): a soft, fully differentiable MoE that is causal by construction.

A sequence is cut into segments of ``segment_len`` tokens. Segment ``j`` is processed by one MLP whose weights are
the experts' merged in parameter space (SMEAR), ``theta_j = sum_e w_je theta_e``, with the weights routed from the
mean of the *previous* segment's inputs::

    w_j = softmax(W_r mean(x[segment j - 1]))        j >= 1 (the mean over its real tokens, padding left out)
    w_0 = softmax(b)                                  a learned mixture: the first segment has no previous one

Every token of segment ``j`` is processed with weights that depend on earlier tokens only, so the layer is
causal; no token is dropped and every expert gets a gradient from every segment. The first segment's mixture is
moekit's choice for segment 0 (data-independent, so that nothing leaks from later tokens). Merging costs
``E / segment_len`` of the tokens' compute; each expert is the size of the dense MLP it replaces, so the FLOPs per
token are the dense model's plus that.

Cached decoding carries, per sequence, the running sum of the current segment's inputs and its weights
(:class:`SegmentState`), so that decoding token by token gives the full forward's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .experts import ExpertsConfig
from .losses import router_z_loss
from .routing import logit_checksum, reset_own_parameters, router_logits, router_precision, router_weight
from .stats import dense_mixture_stats

__all__ = ["LoryMoE", "SegmentState"]


@dataclass
class SegmentState:
    """Where a sequence stands in its current segment (one per layer of a decoding cache).

    Attributes:
        sum_BD: sum of the current segment's (real) inputs so far, per sequence.
        weights_BE: merging weights of the current segment, per sequence.
        count_B: number of inputs in ``sum_BD`` (padding is not summed).

    All three in the routers' precision: float32, float64 for a float64 layer.
    """

    sum_BD: Tensor
    weights_BE: Tensor
    count_B: Tensor


@register_moe_layer("lory")
class LoryMoE(MoELayer):
    """Lory's segment-routed, parameter-merged MoE. ``forward(x, start=0, state=None)``: ``x: [batch, tokens, dim]``
    holds the tokens at positions ``start ..`` of each sequence; ``state`` (:meth:`init_state`) carries the segment
    across the calls of a cached decode (without it the call is a whole sequence from position ``start = 0``).
    Settings: :class:`LoryMoE.Config` and :class:`~moekit.moe.experts.ExpertsConfig` (``num_experts``, 8)."""

    @dataclass(kw_only=True)
    class Config:
        """Attributes:
        segment_len: tokens per segment (routed together, by the previous segment).
        z_loss_weight: ST-MoE router z-loss on the segment logits (0 = off).
        """

        segment_len: int = 64
        z_loss_weight: float = 0.0

        def __post_init__(self) -> None:
            value = self.segment_len
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"segment_len={value!r} must be a positive int (tokens per routed segment)")
            if not self.z_loss_weight >= 0:
                raise ValueError(f"z_loss_weight={self.z_loss_weight!r} must be >= 0")

    configs = (Config, ExpertsConfig)
    defaults = {"num_experts": 8}
    needs_positions = True
    """Its MoE block passes each token's position and the decoding state (:mod:`moekit.models.lm_common`)."""
    merges_experts = True

    def build(self, mlp: MlpSpec, config: Config, experts: ExpertsConfig, *, device=None, dtype=None) -> None:
        self.num_experts = experts.num_experts
        self.segment_len = config.segment_len
        self.z_loss_weight = config.z_loss_weight
        self.router_weight = router_weight(self.num_experts, mlp.in_features, device, dtype)
        self.prior_logits = nn.Parameter(torch.zeros(self.num_experts, device=device, dtype=dtype))  # segment 0
        self.experts = experts.build(mlp, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        reset_own_parameters(self, ("router_weight",))

    @property
    def causal_safe(self) -> bool:
        return True

    def expert_rows_per_token(self, num_tokens: int) -> float:
        return 1.0  # one merged expert per token (merging adds E / segment_len of that)

    def init_state(self, batch: int, like: Tensor) -> SegmentState:
        """The state at position 0 of ``batch`` sequences (on ``like``'s device; float64 when ``like`` is)."""
        dtype = torch.promote_types(like.dtype, torch.float32) if like.is_floating_point() else torch.float32
        zeros = torch.zeros(batch, self.in_features, device=like.device, dtype=dtype)
        return SegmentState(sum_BD=zeros, weights_BE=self._prior(batch).to(dtype), count_B=zeros[:, 0].clone())

    def _prior(self, batch: int) -> Tensor:
        return torch.softmax(router_precision(self.prior_logits), dim=-1).expand(batch, -1)

    def forward(
        self, x: Tensor, start: int = 0, state: SegmentState | None = None, padding_mask: Tensor | None = None
    ) -> Tensor:
        """``x: [batch, tokens, in_features]`` at positions ``start ..`` -> ``[batch, tokens, out_features]``;
        ``padding_mask: [batch, tokens]`` bool, True for real tokens: a segment is routed by the mean of the real
        tokens of the previous one, and padding gets a zero output and counts in no loss or statistic."""
        self._check_input(x)
        batch, tokens, _ = x.shape
        mask_N = self._token_mask(padding_mask, batch, tokens)
        real_BT1 = None if padding_mask is None else padding_mask.unsqueeze(-1)
        if state is None:
            if start != 0:
                raise ValueError(f"LoryMoE: start={start} without a state; a call without one is a whole sequence")
            state = self.init_state(batch, x)
        seg = self.segment_len
        outputs, logits, routed, weights, done = [], [], [], [], 0
        while done < tokens:  # one step per segment the call touches (not per token)
            position = start + done
            count = min(tokens - done, seg - position % seg)  # this call's tokens of the current segment
            if position % seg == 0 and position > 0:  # a segment begins: route it by the previous one
                mean_BD = state.sum_BD / state.count_B.clamp_min(1.0).unsqueeze(1)
                logits_BE = router_logits(mean_BD, self.router_weight)
                state.weights_BE = torch.softmax(logits_BE, dim=-1)
                state.sum_BD = torch.zeros_like(state.sum_BD)
                state.count_B = torch.zeros_like(state.count_B)
                logits.append(logits_BE)
                routed.append(None if real_BT1 is None else real_BT1[:, done : done + count, 0].any(dim=1))
            chunk_BTD = x[:, done : done + count]
            outputs.append(self.experts.merged(chunk_BTD, state.weights_BE))
            weights.append(state.weights_BE.unsqueeze(1).expand(-1, count, -1))
            if real_BT1 is None:
                state.sum_BD = state.sum_BD + router_precision(chunk_BTD).sum(dim=1)
                state.count_B = state.count_B + count
            else:
                real_BT1_chunk = real_BT1[:, done : done + count]
                state.sum_BD = state.sum_BD + (router_precision(chunk_BTD) * real_BT1_chunk).sum(dim=1)
                state.count_B = state.count_B + real_BT1_chunk.sum(dim=(1, 2))
            done += count
        out_BTD = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
        if real_BT1 is not None:
            out_BTD = out_BTD * real_BT1

        losses = {}
        if self.z_loss_weight and logits:  # over the segments that hold real tokens
            segments = None if real_BT1 is None else torch.cat(routed)
            losses["z"] = self.z_loss_weight * router_z_loss(torch.cat(logits), segments)
        gates_NE = torch.cat(weights, dim=1).reshape(batch * tokens, -1).detach()  # each token's mixture
        checksum = logit_checksum(self.prior_logits, *logits)  # segment 0's learned logits and the routed ones
        self._record(losses, lambda: dense_mixture_stats(gates_NE, mask_N), batch * tokens, checksum)
        return out_BTD

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, segment_len={self.segment_len}"
