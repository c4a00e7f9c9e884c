"""Mixture-of-Depths (Raposo et al. 2024): a router in front of a Transformer block sends the top-C tokens of
each sequence through the block (attention + MLP) and the others around it, on the residual path.

For a block that computes ``x + f(x)`` and a router logit ``r_i = w . x_i + b`` per token::

    x_i' = x_i + g(r_i) f_i(X~)    if r_i is among the top C = ceil(capacity * tokens) of its sequence
    x_i' = x_i                      otherwise

where ``X~`` holds the chosen tokens only (attention runs among them, in sequence order) and ``g`` is the
identity (the paper's equation, ``gate="logit"``) or a sigmoid: multiplying by the router's output puts the
router on the gradient path. Compute per token falls to about ``capacity`` of the block's (attention to about
``capacity^2``). The paper's router has no bias ``b``; the top-C choice does not depend on it, but the causal
decision ``r_i > 0`` below needs it to place its threshold when the residual stream has no constant direction
(it starts at 0).

The top-C of a sequence looks at its later tokens, so a causal model cannot sample with it. A causal router
also learns a per-token decision, by a binary cross-entropy against the top-C choice (the ``mod_bce`` aux
loss): on the router logits themselves (``causal_router="aux_loss"``, process when ``r_i > 0``) or on a small
MLP predictor that reads the router's input with the gradient stopped (``"predictor"``). In training the block
routes top-C; in eval mode a causal router decides per token (:meth:`DepthRouter.decide`), which is what
sampling needs; :func:`top_c_routing` switches eval back to top-C (the model summary measures FLOPs so).

Statistics (:attr:`DepthRouter.stats`): ``processed_fraction`` (of the tokens), ``mean_gate`` (over processed
tokens), and for a causal router ``topc_agreement``: the fraction of tokens on which the per-token decision
equals the top-C choice (the paper reports ~97% for both methods).

Padding (``padding_mask`` False) is never processed and counts in no loss or statistic; a sequence of ``n`` real
tokens sends ``ceil(capacity * n)`` of them through the block.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.recipes.depth import DepthSpec

from .base import RoutingModule
from .losses import masked_mean
from .routing import logit_checksum, router_logits, router_precision
from .stats import REAL_TOKENS, real_tokens

__all__ = ["DepthRouter", "MixtureOfDepths", "capacity_tokens", "depth_routers", "top_c_routing"]

ROUTER_INIT_STD = 0.02
"""Std of the truncated normal the router projection starts from (timm's ``nn.Linear`` initialisation)."""


def capacity_tokens(capacity: float, tokens: int | Tensor) -> int | Tensor:
    """``C = ceil(capacity * tokens)``: how many of a sequence's ``tokens`` a routed block processes (elementwise for
    a tensor of real-token counts)."""
    if isinstance(tokens, Tensor):
        return torch.ceil(capacity * tokens.double() - 1e-9).clamp_min(1).long()
    return max(1, math.ceil(capacity * tokens - 1e-9))


class DepthRouter(RoutingModule):
    """The router of one block: a scalar logit per token (float32), the top-C choice and, for a causal
    model, the per-token decision with its auxiliary cross-entropy.

    Args:
        dim: token width.
        spec: the settings (:class:`~moekit.recipes.depth.DepthSpec`).
        causal: the model is causal: eval mode decides per token, training adds the ``mod_bce`` aux loss
            (and builds the predictor when ``spec.causal_router == "predictor"``).

    Attributes:
        capacity: ``spec.capacity``.
        top_c_in_eval: eval mode of a causal router routes top-C as training does (looks ahead; set by
            :func:`top_c_routing`).
    """

    def __init__(self, dim: int, spec: DepthSpec, *, causal: bool, compute_stats: bool = True, device=None) -> None:
        super().__init__(compute_stats=compute_stats)
        self.spec = spec
        self.capacity = spec.capacity
        self.causal = causal
        self.top_c_in_eval = False
        self.weight = nn.Parameter(torch.empty(1, dim, device=device))
        self.bias = nn.Parameter(torch.empty(1, device=device))  # [1], not a scalar: FSDP2 shards no 0-dim tensor
        self.reset_parameters()
        self.predictor: nn.Sequential | None = None
        if causal and spec.causal_router == "predictor":
            hidden = spec.predictor_hidden or max(1, dim // 4)
            self.predictor = nn.Sequential(
                nn.Linear(dim, hidden, device=device), nn.SiLU(), nn.Linear(hidden, 1, device=device)
            )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The projection from a truncated normal, the bias 0 (also for a router built on the meta device)."""
        nn.init.trunc_normal_(self.weight, std=ROUTER_INIT_STD)
        self.bias.zero_()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Also loads the scalar bias of earlier checkpoints."""
        bias = state_dict.get(prefix + "bias")
        if isinstance(bias, Tensor) and bias.dim() == 0:
            state_dict[prefix + "bias"] = bias.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def routes_top_c(self) -> bool:
        """Whether this forward routes top-C (training, non-causal models, :func:`top_c_routing`)."""
        return self.training or not self.causal or self.top_c_in_eval

    def logits(self, x_BSD: Tensor) -> Tensor:
        """Router logits ``[B, S]`` in float32."""
        return router_logits(x_BSD, self.weight).squeeze(-1) + self.bias

    def gate(self, logits: Tensor) -> Tensor:
        return logits.sigmoid() if self.spec.gate == "sigmoid" else logits

    def _decision_logits(self, x_BSD: Tensor, logits_BS: Tensor) -> Tensor:
        """What the per-token decision thresholds at 0: the router logits, or the predictor's (it reads
        the router's input with the gradient stopped, so its loss trains the predictor alone). The predictor
        computes as the router does, in (at least) float32 whatever the model's dtype (bf16, float64)."""
        if self.predictor is None:
            return logits_BS
        first, act, last = self.predictor
        with torch.autocast(x_BSD.device.type, enabled=False):
            x_BSD = router_precision(x_BSD.detach())
            hidden_BSH = act(F.linear(x_BSD, first.weight.to(x_BSD.dtype), first.bias.to(x_BSD.dtype)))
            return F.linear(hidden_BSH, last.weight.to(x_BSD.dtype), last.bias.to(x_BSD.dtype)).squeeze(-1)

    def route(self, x_BSD: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Top-C routing: ``(indices [B, C] in sequence order, gates [B, C] float32, taken [B, C] bool or None)``.

        With ``padding_mask: [B, S]`` (True for real tokens) ``C`` stays that of ``S`` tokens (static shapes) and a
        sequence of ``n`` real tokens fills ``ceil(capacity * n)`` slots with its best real tokens: ``taken`` marks
        them, the other slots get gate 0 (and must be hidden from the chosen tokens' attention)."""
        batch, tokens, _ = x_BSD.shape
        mask_N = self._token_mask(padding_mask, batch, tokens)
        logits_BS = self.logits(x_BSD)
        capacity = capacity_tokens(self.capacity, tokens)
        taken_BC = None
        if padding_mask is None:
            top_BC = logits_BS.topk(capacity, dim=1, sorted=False).indices
            top_BC = top_BC.sort(dim=1).values  # sequence order: causal attention among the chosen stays causal
        else:
            ranked_BC = logits_BS.masked_fill(~padding_mask, -math.inf).topk(capacity, dim=1).indices  # best first
            filled_B1 = capacity_tokens(self.capacity, padding_mask.sum(dim=1)).unsqueeze(1)
            taken_BC = (torch.arange(capacity, device=x_BSD.device) < filled_B1) & padding_mask.gather(1, ranked_BC)
            top_BC, order_BC = ranked_BC.sort(dim=1)
            taken_BC = taken_BC.gather(1, order_BC)
        gates_BC = self.gate(logits_BS.gather(1, top_BC))
        if taken_BC is not None:
            gates_BC = gates_BC * taken_BC
        taken = True if taken_BC is None else taken_BC
        chosen_BS = torch.zeros_like(logits_BS, dtype=torch.bool).scatter_(1, top_BC, taken)
        aux: dict[str, Tensor] = {}
        decision_BS = None
        if self.causal:
            decision_BS = self._decision_logits(x_BSD, logits_BS)
            if self.training and self.spec.aux_loss_weight > 0:
                bce_BS = F.binary_cross_entropy_with_logits(decision_BS, chosen_BS.float(), reduction="none")
                aux["mod_bce"] = self.spec.aux_loss_weight * masked_mean(bce_BS.reshape(-1), mask_N)
        gates, decision = gates_BC.detach(), None if decision_BS is None else decision_BS.detach()

        def stats() -> dict[str, Tensor]:
            out = {
                "processed_fraction": masked_mean(chosen_BS.float().reshape(-1), mask_N),
                "mean_gate": gates.sum() / chosen_BS.sum().clamp_min(1),
                REAL_TOKENS: real_tokens(logits_BS, batch * tokens, mask_N),
            }
            if decision is not None:
                out["topc_agreement"] = masked_mean(((decision > 0) == chosen_BS).float().reshape(-1), mask_N)
            return out

        self._record(aux, stats, batch * tokens, logit_checksum(logits_BS))
        return top_BC, gates_BC, taken_BC

    def decide(
        self, x_BSD: Tensor, *, whole_sequences: bool = True, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Per-token (causal) routing: ``(processed [B, S] bool, gates [B, S] float32)``, the gate 0 where a
        token is not processed (padding, ``padding_mask`` False, never is). ``whole_sequences``: ``x`` holds whole
        sequences (not a cached piece), so the agreement with top-C can be measured."""
        batch, tokens, _ = x_BSD.shape
        mask_N = self._token_mask(padding_mask, batch, tokens)
        logits_BS = self.logits(x_BSD)
        processed_BS = self._decision_logits(x_BSD, logits_BS) > 0
        if padding_mask is not None:
            processed_BS = processed_BS & padding_mask
        gates_BS = torch.where(processed_BS, self.gate(logits_BS), 0.0)
        detached = logits_BS.detach()
        if padding_mask is not None:
            detached = detached.masked_fill(~padding_mask, -math.inf)

        def stats() -> dict[str, Tensor]:
            out = {
                "processed_fraction": masked_mean(processed_BS.float().reshape(-1), mask_N),
                "mean_gate": gates_BS.sum() / processed_BS.sum().clamp(min=1),
                REAL_TOKENS: real_tokens(logits_BS, batch * tokens, mask_N),
            }
            if whole_sequences:
                ranked_BC = detached.topk(capacity_tokens(self.capacity, tokens), dim=1).indices
                taken_BC = True
                if padding_mask is not None:
                    filled_B1 = capacity_tokens(self.capacity, padding_mask.sum(dim=1)).unsqueeze(1)
                    taken_BC = torch.arange(ranked_BC.shape[1], device=ranked_BC.device) < filled_B1
                chosen_BS = torch.zeros_like(processed_BS).scatter_(1, ranked_BC, taken_BC)
                out["topc_agreement"] = masked_mean((processed_BS == chosen_BS).float().reshape(-1), mask_N)
            return out

        self._record({}, stats, batch * tokens, logit_checksum(logits_BS))
        return processed_BS, gates_BS


class MixtureOfDepths(nn.Module):
    """A block ``x -> x + f(x)`` (a timm ViT ``Block``) behind a :class:`DepthRouter`: the top-C tokens of each
    sequence run through the block, the others pass unchanged. ``[B, S, D] -> [B, S, D]``.

    The block's update of a chosen token is ``block(X~) - X~``; it is scaled by the token's gate and added back
    to the token's place. The first ``prefix_tokens`` (a class token) always go through the block, unscaled,
    and the top-C are chosen among the others. The router is not causal: use it in non-causal models.
    """

    def __init__(self, block: nn.Module, router: DepthRouter, prefix_tokens: int = 0) -> None:
        super().__init__()
        if router.causal:
            raise ValueError("MixtureOfDepths wraps blocks of non-causal models; pass a DepthRouter(causal=False)")
        self.block = block
        self.depth_router = router
        self.prefix_tokens = prefix_tokens

    def forward(self, x_BSD: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError(
                "MixtureOfDepths: an attention mask over all tokens does not fit a block that sees the chosen "
                "tokens only; call the model without attn_mask / is_causal"
            )
        prefix = self.prefix_tokens
        batch, _, dim = x_BSD.shape
        prefix_BPD, x_BND = x_BSD[:, :prefix], x_BSD[:, prefix:]
        top_BC, gates_BC, _ = self.depth_router.route(x_BND)
        index_BCD = top_BC.unsqueeze(-1).expand(-1, -1, dim)
        chosen_BKD = torch.cat([prefix_BPD, x_BND.gather(1, index_BCD)], dim=1)  # K = prefix + C
        update_BKD = self.block(chosen_BKD) - chosen_BKD
        update_BCD = gates_BC.unsqueeze(-1) * update_BKD[:, prefix:]
        x_BND = x_BND.scatter_add(1, index_BCD, update_BCD.to(x_BND.dtype))
        return torch.cat([prefix_BPD + update_BKD[:, :prefix], x_BND], dim=1)


def depth_routers(model: nn.Module) -> Iterator[tuple[str, DepthRouter]]:
    """Yield ``(qualified_name, router)`` for every :class:`DepthRouter` inside ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, DepthRouter):
            yield name, module


@contextlib.contextmanager
def top_c_routing(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, causal routers of ``model`` route top-C in eval mode too (the routing training
    uses, which looks ahead in a sequence: for measuring compute or the agreement, not for sampling)."""
    routers = [router for _, router in depth_routers(model)]
    before = [router.top_c_in_eval for router in routers]
    for router in routers:
        router.top_c_in_eval = True
    try:
        yield model
    finally:
        for router, flag in zip(routers, before):
            router.top_c_in_eval = flag
