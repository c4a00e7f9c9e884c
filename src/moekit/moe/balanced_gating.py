"""Strictly balanced gating (Shazeer et al. 2017, appendix F).

Gate scores ``G_sigma(x) = softmax(x W_g)`` over ``E`` experts; the gates are the scores a mask keeps, renormalised
per token, ``G(x)_e = G_sigma(x)_e M_e / sum_e' G_sigma(x)_e' M_e'`` (a token the mask gives no expert gets a zero
output, so the block's residual carries it).

* Training - the batchwise mask: each expert takes the ``m = R(k N / E)`` tokens of the batch with its highest
  scores, so every expert gets exactly the same number of tokens and a token gets ``k`` experts on average.
  ``balance_scope="position"`` applies it to the tokens of each sequence position separately (``m = R(k B / E)``
  of the ``B`` tokens at that position): the routing of a token then never looks at later tokens, so a causal
  language model can train with it.
* Inference - the threshold mask ``M_threshold(x)_e = [G_sigma(x)_e > T_e]``, per token, so it runs at batch size
  1 and in a decoder. The thresholds ``T`` are parameters trained by ``L_batchwise`` (the ``threshold`` aux loss,
  :func:`~moekit.moe.losses.batchwise_threshold_loss`, on detached scores: it trains the thresholds only) to make
  the threshold mask agree with the batchwise one. They start at the cut-offs of the first training batch; a
  layer that has never trained has no thresholds yet and routes with the batchwise mask in eval mode too.

Padding (``padding_mask`` False) gets no expert and does not count in ``N`` (nor in a position's ``B``), nor in the
losses and statistics.

Shapes: ``B`` batch, ``T`` tokens per sequence, ``N = B * T``, ``D`` width, ``E`` experts, ``C`` tokens per expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .capacity import experts_choice_capacity
from .dispatch import apply_experts, plan_dispatch
from .experts import ExpertsConfig
from .losses import batchwise_threshold_loss, router_z_loss
from .routing import expert_softmax, logit_checksum, reset_own_parameters, router_logits, router_weight
from .stats import strictly_balanced_stats

__all__ = ["StrictlyBalancedMoE"]


@register_moe_layer("strictly_balanced")
class StrictlyBalancedMoE(MoELayer):
    """Strictly balanced gating: the batchwise mask in training, learned per-expert thresholds at inference.

    Settings: :class:`StrictlyBalancedMoE.Config` and :class:`~moekit.moe.experts.ExpertsConfig` (``num_experts``).
    """

    @dataclass(kw_only=True)
    class Config:
        """Attributes:
        top_k: ``k``, the average number of experts per token (each expert takes ``R(k N / E)`` tokens).
        balance_scope: ``"batch"`` (the paper's: all tokens of the forward) or ``"position"`` (the tokens of each
            sequence position; causal; training batches of at least ``num_experts / top_k`` sequences, so that
            each expert's share of a position's tokens is one or more).
        threshold_loss_weight: the weight of ``L_batchwise``, which trains the thresholds.
        z_loss_weight: ST-MoE router z-loss weight (0 = off).
        """

        top_k: int = 2
        balance_scope: Literal["batch", "position"] = "batch"
        threshold_loss_weight: float = 1.0
        z_loss_weight: float = 0.0

        def __post_init__(self) -> None:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
                raise ValueError(f"top_k={self.top_k!r} must be a positive int (the average experts per token)")
            if self.balance_scope not in ("batch", "position"):
                raise ValueError(f"balance_scope={self.balance_scope!r}; allowed: 'batch', 'position' (causal)")
            for name in ("threshold_loss_weight", "z_loss_weight"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                    raise ValueError(f"{name}={value!r} must be a finite number >= 0 (0 turns it off)")

    configs = (Config, ExpertsConfig)

    def build(self, mlp: MlpSpec, config: Config, experts: ExpertsConfig, *, device=None, dtype=None) -> None:
        self.num_experts = experts.num_experts
        if config.top_k > self.num_experts:
            raise ValueError(f"top_k={config.top_k} must be at most num_experts={self.num_experts}")
        self.top_k = config.top_k
        self.balance_scope = config.balance_scope
        self.threshold_loss_weight = config.threshold_loss_weight
        self.z_loss_weight = config.z_loss_weight
        self.router_weight = router_weight(self.num_experts, mlp.in_features, device, dtype)
        # Trained by L_batchwise alone: with its weight 0 they keep their first-batch values and take no gradient
        # (a parameter without one stops DDP without find_unused_parameters).
        threshold_dtype = torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)  # the scores', >= fp32
        self.thresholds = nn.Parameter(
            torch.zeros(self.num_experts, device=device, dtype=threshold_dtype),
            requires_grad=bool(config.threshold_loss_weight),
        )
        self.register_buffer("thresholds_set", torch.zeros((), dtype=torch.bool, device=device))
        self._thresholds_set = False  # host copy of the buffer, so that forwards never read it from the device
        self.register_load_state_dict_post_hook(_read_host_flag)
        self.experts = experts.build(mlp, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The router redrawn, the thresholds unset (also for a layer built on the meta device)."""
        reset_own_parameters(self, ("router_weight",))
        self.thresholds_set.fill_(False)
        self._thresholds_set = False

    @property
    def causal_safe(self) -> bool:
        return self.balance_scope == "position"

    def expert_rows_per_token(self, num_tokens: int) -> float:
        # Training and an untrained layer: exactly C * E / N; trained thresholds aim at the same average.
        return self.tokens_per_expert(num_tokens) * self.num_experts / num_tokens

    def tokens_per_expert(self, num_tokens: int) -> int:
        """``m = R(k N / E)``: the tokens each expert takes from ``num_tokens`` competing tokens."""
        return experts_choice_capacity(num_tokens, self.num_experts, self.top_k)

    def has_thresholds(self) -> bool:
        """Whether the thresholds have been set by a training batch."""
        return self._thresholds_set

    def batchwise_token_ids(
        self, scores_NE: Tensor, batch: int, tokens: int, mask_N: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``(token_ids [E, C], taken [E, C] or None)``: the tokens each expert takes, its top ``m`` of the batch (or
        of each position's ``B``). With ``mask_N`` (False for padding) ``m`` counts the real tokens and ``C`` stays
        that of all tokens (static shapes): ``taken`` marks the slots that hold one of an expert's ``m``."""
        scores_NE = scores_NE if mask_N is None else torch.where(mask_N.unsqueeze(1), scores_NE, -1.0)
        if self.balance_scope == "batch":
            top = scores_NE.t().topk(self.tokens_per_expert(batch * tokens), dim=-1)
            if mask_N is None:
                return top.indices, None
            filled = self.tokens_per_expert(mask_N.sum())
            taken_EC = torch.arange(top.indices.shape[1], device=scores_NE.device) < filled
            return top.indices, taken_EC & (top.values >= 0)
        scores_TEB = scores_NE.view(batch, tokens, -1).permute(1, 2, 0)
        top = scores_TEB.topk(self.tokens_per_expert(batch), dim=-1)  # batch rows per position
        positions = torch.arange(tokens, device=scores_NE.device).view(tokens, 1, 1)
        token_ids_EC = (top.indices * tokens + positions).permute(1, 0, 2).reshape(self.num_experts, -1)
        if mask_N is None:
            return token_ids_EC, None
        filled_T11 = self.tokens_per_expert(mask_N.view(batch, tokens).sum(dim=0)).view(tokens, 1, 1)
        taken_TEM = (torch.arange(top.indices.shape[2], device=scores_NE.device) < filled_T11) & (top.values >= 0)
        return token_ids_EC, taken_TEM.permute(1, 0, 2).reshape(self.num_experts, -1)

    @torch.no_grad()
    def _set_thresholds(self, scores_NE: Tensor, batch: int, tokens: int, mask_N: Tensor | None) -> None:
        """Start each threshold at the largest score its expert did not take: the threshold mask then keeps as many
        tokens per expert of this batch as the batchwise mask took (``m``; ``balance_scope="position"``: each
        position's ``m`` summed over the positions), up to ties; averaged over the processes of a distributed run.
        ``mask_N`` (False for padding) leaves padding out."""
        if mask_N is not None:
            scores_NE = scores_NE[mask_N]
        num_tokens = scores_NE.shape[0]
        if self.balance_scope == "batch":
            taken = self.tokens_per_expert(num_tokens)
        else:  # the real tokens of each position, or the batch's rows where there is no padding
            per_position = torch.full((tokens,), batch) if mask_N is None else mask_N.view(batch, tokens).sum(dim=0)
            taken = int(self.tokens_per_expert(per_position).sum())
        below = num_tokens - taken
        # [E thresholds, 1 if this process had real tokens]: a process whose batch is all padding adds nothing
        thresholds_E1 = self.thresholds.new_zeros(self.num_experts + 1)
        if num_tokens:
            thresholds_E1[-1] = 1.0
            if below > 0:  # else every expert took every token: the threshold 0 lets every token in
                thresholds_E1[:-1] = scores_NE.t().kthvalue(below, dim=-1).values
        if dist.is_available() and dist.is_initialized():  # every rank, also an empty one: the same thresholds
            dist.all_reduce(thresholds_E1)
            contributors = round(thresholds_E1[-1].item())
        else:
            contributors = 1 if num_tokens else 0
        if contributors == 0:  # no real token anywhere: the next training batch sets them
            return
        self.thresholds.copy_(thresholds_E1[:-1] / contributors)
        self.thresholds_set.fill_(True)
        self._thresholds_set = True

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``; ``padding_mask: [batch,
        tokens]`` bool, True for real tokens."""
        self._check_input(x)
        B, T, D = x.shape
        if self.training and self.balance_scope == "position" and self.top_k * B < self.num_experts:
            raise ValueError(
                f"balance_scope='position' with top_k={self.top_k} and num_experts={self.num_experts} needs batches of "
                f"at least {math.ceil(self.num_experts / self.top_k)} sequences: each expert takes at least one of a "
                f"position's {B} tokens, so a token would get about {self.num_experts / B:g} experts, not "
                f"{self.top_k}; train with larger batches, fewer experts, or balance_scope='batch' (non-causal models)"
            )
        mask_N = self._token_mask(padding_mask, B, T)
        x_ND = x.reshape(B * T, D)
        logits_NE = router_logits(x_ND, self.router_weight)
        scores_NE = expert_softmax(logits_NE)
        if self.training and not self.has_thresholds():  # once: the first training batch
            self._set_thresholds(scores_NE.detach(), B, T, mask_N)

        losses: dict[str, Tensor] = {}
        if not self.training and self.has_thresholds():
            mask_NE = scores_NE > self.thresholds
            if mask_N is not None:
                mask_NE = mask_NE & mask_N.unsqueeze(1)
            out_NO, counts_E = self._threshold_forward(x_ND, scores_NE, mask_NE)
        else:
            token_ids_EC, taken_EC = self.batchwise_token_ids(scores_NE, B, T, mask_N)
            taken = True if taken_EC is None else taken_EC
            mask_NE = torch.zeros_like(scores_NE, dtype=torch.bool).t().scatter_(1, token_ids_EC, taken).t()
            out_NO = self._batchwise_forward(x_ND, scores_NE, mask_NE, token_ids_EC)
            if taken_EC is None:
                counts_E = torch.full((self.num_experts,), token_ids_EC.shape[1], device=x.device)
            else:
                counts_E = taken_EC.sum(dim=1)
            if self.training and self.threshold_loss_weight:
                losses["threshold"] = self.threshold_loss_weight * batchwise_threshold_loss(
                    scores_NE.detach(), self.thresholds, mask_NE, mask_N
                )
        if self.z_loss_weight:
            losses["z"] = self.z_loss_weight * router_z_loss(logits_NE, mask_N)

        probs, mask, thresholds = scores_NE.detach(), mask_NE, self.thresholds.detach()
        self._record(
            losses,
            lambda: strictly_balanced_stats(probs, mask, counts_E, thresholds if self.training else None, mask_N),
            B * T,
            logit_checksum(logits_NE),
        )
        return out_NO.view(B, T, -1)

    @staticmethod
    def _gates(scores_NE: Tensor, mask_NE: Tensor) -> Tensor:
        """``G = G_sigma M / sum_e G_sigma M`` (zero for a token with no expert)."""
        kept_NE = scores_NE * mask_NE
        return kept_NE / kept_NE.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(kept_NE.dtype).tiny)

    def _batchwise_forward(self, x_ND: Tensor, scores_NE: Tensor, mask_NE: Tensor, token_ids_EC: Tensor) -> Tensor:
        flat = token_ids_EC.reshape(-1)
        expert_out = self.experts(x_ND.index_select(0, flat), token_ids_EC.shape[1])  # [E * C, O]
        gates_EC = self._gates(scores_NE, mask_NE).t().gather(1, token_ids_EC)
        weighted = expert_out * gates_EC.reshape(-1, 1).to(expert_out.dtype)
        return weighted.new_zeros(x_ND.shape[0], weighted.shape[-1]).index_add_(0, flat, weighted)

    def _threshold_forward(self, x_ND: Tensor, scores_NE: Tensor, mask_NE: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens-choice dispatch with a variable number of experts per token (the ``E`` candidates of every token,
        the masked ones dropped)."""
        expert_ids_NE = torch.arange(self.num_experts, device=x_ND.device).expand_as(mask_NE)
        plan = plan_dispatch(expert_ids_NE, self.num_experts, keep=mask_NE)
        return apply_experts(self.experts, x_ND, plan, self._gates(scores_NE, mask_NE)), plan.counts

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, balance_scope={self.balance_scope!r}"


def _read_host_flag(module: StrictlyBalancedMoE, incompatible_keys) -> None:
    module._thresholds_set = bool(module.thresholds_set)
