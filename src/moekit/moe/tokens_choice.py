"""Tokens-choice MoE layers: every token picks ``k`` experts.

:class:`TokensChoiceMoE` holds what all of them share - the expert bank, optional always-on shared experts
(DeepSeekMoE), expert capacity with Batch Prioritized Routing, dispatch and combine, statistics - and each
subclass names its router:

* :class:`TopKMoE` - softmax/sigmoid top-k: Switch (k=1), GShard/Mixtral (k=2, renormalised), Shazeer's
  noisy top-k, V-MoE, DeepSeekMoE shared + fine-grained experts, loss-free balancing;
* :class:`HashMoE` - fixed token-id hash routing;
* :class:`BaseMoE` - BASE layers' balanced assignment;
* :class:`HierarchicalMoE` - Shazeer's two-level gating.

An assignment dropped by capacity contributes nothing, and the token's other gates are not renormalised (GShard); a
token whose assignments are all dropped gets a zero routed output (the shared experts' output still adds), so the
block's residual connection passes it through. Padding (``padding_mask`` False) gets no expert and a zero output,
takes no capacity, and counts in no loss or statistic; capacity is then counted from the real tokens (of the batch,
or of each position), except in the ``"group"`` scope, whose capacity comes from ``group_size`` so that it never
depends on later tokens.

Shapes: ``B`` batch, ``T`` tokens per sequence, ``N = B * T`` tokens, ``D`` width, ``K`` experts per token,
``E`` experts, ``O`` output width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .capacity import Capacity, check_factor, tokens_choice_capacity
from .dispatch import DispatchPlan, apply_experts, plan_dispatch
from .experts import ExpertsConfig
from .hash_routing import HashRouter
from .hierarchical_routing import HierarchicalRouter
from .routers import BalancedRouter, TopKRouter
from .routing import Router, Routing, count_ids
from .stats import tokens_choice_stats

__all__ = ["TokensChoiceMoE", "SharedExperts", "TopKMoE", "HashMoE", "BaseMoE", "HierarchicalMoE"]


@dataclass(kw_only=True)
class SharedExperts:
    """``num_shared_experts`` always-on experts of the routed experts' hidden size, applied to every token and
    added to the routed output (DeepSeekMoE); computed as one dense MLP of ``num_shared_experts`` x that size.
    ``shared_expert_gate`` scales their output per token by ``sigmoid(x w)``, a learned gate (Qwen1.5-MoE)."""

    num_shared_experts: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        value = self.num_shared_experts
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"num_shared_experts={value!r} must be an int >= 0")
        if self.shared_expert_gate and not value:
            raise ValueError("shared_expert_gate=True gates the shared experts, but num_shared_experts=0; set both")


@dataclass
class GroupCounts:
    """A decoding cache's state of a layer with ``capacity_scope="group"``: ``counts_BE``, the assignments each
    sequence's current group has sent to each expert so far (dropped ones included)."""

    counts_BE: Tensor


class TokensChoiceMoE(MoELayer):
    """Base of the tokens-choice layers. A subclass sets :attr:`Router` and :attr:`configs`: its router's
    ``Config``, :class:`~moekit.moe.experts.ExpertsConfig`, and, where it takes them,
    :class:`~moekit.moe.capacity.Capacity` and :class:`SharedExperts`; their fields are its settings.

    ``forward(x, token_ids=None, start=0, state=None, padding_mask=None)``: ``x: [batch, tokens, in_features]``;
    ``token_ids: [batch, tokens]`` are read by routers that route by id (:class:`HashMoE`). With
    ``capacity_scope="group"`` the tokens sit at positions ``start ..`` of their sequences and ``state``
    (:meth:`init_state`) carries the current group's counts across the calls of a cached decode (without it, a call
    is a whole sequence from position 0). ``padding_mask: [batch, tokens]`` bool, True for real tokens.
    """

    Router: ClassVar[type[Router]]

    def build(self, mlp: MlpSpec, router: object, experts: ExpertsConfig, *extra: object, device=None, dtype=None):
        options = {type(config): config for config in extra}
        self.router = self.Router(mlp.in_features, router, device=device, dtype=dtype)
        self.num_experts = self.router.num_experts
        self.top_k = self.router.top_k
        self.capacity = options.get(Capacity, Capacity())
        # The factors again, as integers in units of 1e-9, in a buffer: a compiled forward reads them as data, so the
        # capacity tuner's changes do not recompile it (dynamo guards on a Python float's value).
        self.register_buffer("capacity_factors_e9", torch.zeros(2, dtype=torch.long, device=device), persistent=False)
        self._sync_factors()
        self.experts = experts.build(mlp, num_experts=self.num_experts, device=device, dtype=dtype)
        shared = options.get(SharedExperts, SharedExperts())
        self.shared_experts = (
            experts.build(
                mlp,
                num_experts=1,
                hidden_features=shared.num_shared_experts * mlp.hidden_features,
                device=device,
                dtype=dtype,
            )
            if shared.num_shared_experts
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(mlp.in_features, 1, bias=False, device=device, dtype=dtype) if shared.shared_expert_gate else None
        )

    def reset_parameters(self) -> None:
        """Refill the capacity buffer (for a layer built on the meta device and materialised with ``to_empty``)."""
        self._sync_factors()

    # The capacity factors are attributes of the layer for the capacity tuner (moekit.callbacks.CapacityTuner).
    @property
    def capacity_factor(self) -> float | None:
        return self.capacity.capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value: float | None) -> None:
        check_factor(value, "capacity_factor", optional=True)
        self.capacity.capacity_factor = value
        self._sync_factors()

    @property
    def eval_capacity_factor(self) -> float | None:
        return self.capacity.eval_capacity_factor

    @eval_capacity_factor.setter
    def eval_capacity_factor(self, value: float | None) -> None:
        check_factor(value, "eval_capacity_factor", optional=True)
        self.capacity.eval_capacity_factor = value
        self._sync_factors()

    def _sync_factors(self) -> None:
        factors = (self.capacity.capacity_factor, self.capacity.eval_capacity_factor)
        self._dropless = tuple(factor is None for factor in factors)  # (training, eval): structural, guarded on
        with torch.no_grad():
            self.capacity_factors_e9.copy_(torch.tensor([round((factor or 0) * 1e9) for factor in factors]))

    def _factor(self) -> float | Tensor | None:
        """The capacity factor of the current mode: a float, or under ``torch.compile`` a float64 device scalar read
        from :attr:`capacity_factors_e9` (the same value: ``n / 1e9`` is the float nearest to the factor)."""
        if self._dropless[0 if self.training else 1]:
            return None
        if torch.compiler.is_compiling():
            return self.capacity_factors_e9[0 if self.training else 1].double() / 1e9
        return self.capacity.factor(self.training)

    @property
    def causal_safe(self) -> bool:
        scope = self.capacity.capacity_scope
        return (
            self.capacity.dropless
            or scope == "position"
            or (scope == "group" and not self.capacity.batch_priority)  # token order within a group: causal
        )

    @property
    def needs_positions(self) -> bool:
        """Groups of consecutive tokens: a model passes positions and, when decoding, the group counts."""
        return self.capacity.capacity_scope == "group"

    def init_state(self, batch: int, like: Tensor) -> GroupCounts:
        """The decoding state at position 0 of ``batch`` sequences (on ``like``'s device)."""
        return GroupCounts(torch.zeros(batch, self.num_experts, dtype=torch.long, device=like.device))

    def expert_rows_per_token(self, num_tokens: int) -> float:
        # With a per-position capacity the drops depend on the batch size, not on num_tokens: report k.
        scope, capacity = self.capacity.capacity_scope, None
        if scope == "batch":
            capacity = self.expert_capacity(num_tokens)
        elif scope == "group":
            num_tokens = self.capacity.group_size or num_tokens
            capacity = self.expert_capacity(num_tokens)
        routed = self.top_k if capacity is None else min(self.top_k, capacity * self.num_experts / num_tokens)
        shared = self.shared_experts.hidden_features / self.experts.hidden_features if self.shared_experts else 0.0
        return routed + shared

    def expert_capacity(self, num_tokens: int | Tensor) -> int | Tensor | None:
        """Assignments each expert may take from ``num_tokens`` competing tokens (None: dropless; a tensor for a
        count on device)."""
        factor = self._factor()
        return None if factor is None else tokens_choice_capacity(num_tokens, self.top_k, self.num_experts, factor)

    def plan(
        self,
        routing: Routing,
        batch: int,
        tokens: int,
        start: int = 0,
        state: GroupCounts | None = None,
        mask_N: Tensor | None = None,
    ) -> DispatchPlan:
        """Apply capacity (and Batch Prioritized Routing) to the routing of ``batch * tokens`` tokens
        (flattened batch-major) at positions ``start ..`` of their sequences; ``mask_N`` marks the real ones."""
        priority = routing.priority if self.capacity.batch_priority else None
        scope, expert_ids_NK = self.capacity.capacity_scope, routing.expert_ids
        if scope == "group":
            return self._plan_groups(expert_ids_NK, priority, batch, tokens, start, state, mask_N)
        if scope == "batch":
            competing = batch * tokens if mask_N is None else mask_N.sum()
            capacity = self.expert_capacity(competing)
            return plan_dispatch(expert_ids_NK, self.num_experts, capacity, priority, valid=mask_N)
        positions = torch.arange(tokens, device=expert_ids_NK.device).repeat(batch)
        competing = batch if mask_N is None else mask_N.view(batch, tokens).sum(dim=0)  # [T] real tokens
        return plan_dispatch(
            expert_ids_NK,
            self.num_experts,
            self.expert_capacity(competing),
            priority,
            group_ids=positions,
            num_groups=tokens,
            valid=mask_N,
        )

    def _plan_groups(
        self,
        expert_ids_NK: Tensor,
        priority: Tensor | None,
        batch: int,
        tokens: int,
        start: int,
        state,
        mask_N: Tensor | None,
    ) -> DispatchPlan:
        """Capacity per group of ``group_size`` consecutive positions of each sequence, in token order (with Batch
        Prioritized Routing: all first choices by priority, then the second ones, as V-MoE's groups)."""
        if state is None and start != 0:
            raise ValueError(
                f"{type(self).__name__}: start={start} without a state; a call without one is a whole sequence"
            )
        if state is not None and self.capacity.group_size is None:
            raise ValueError(
                f"{type(self).__name__}: capacity_scope='group' with group_size=None counts the tokens of each call as "
                "one group, so a sequence decoded in pieces would get fresh capacity at every call; set group_size "
                "(the sequence length, as the Transformer LM does with max_seq_len)"
            )
        size = self.capacity.group_size or tokens
        factor = self._factor()
        first = start // size
        groups = (start + tokens - 1) // size - first + 1  # the groups of each sequence this call touches
        local_T = torch.arange(start, start + tokens, device=expert_ids_NK.device) // size - first
        group_ids_N = (torch.arange(batch, device=local_T.device).unsqueeze(1) * groups + local_T).reshape(-1)
        num_experts = self.num_experts
        earlier = None
        if state is not None and start % size:  # the first group continues from earlier calls
            earlier = torch.zeros(batch, groups, num_experts, dtype=torch.long, device=local_T.device)
            earlier[:, 0] = state.counts_BE
        capacity = None if factor is None else tokens_choice_capacity(size, self.top_k, num_experts, factor)
        plan = plan_dispatch(
            expert_ids_NK,
            num_experts,
            capacity,
            priority,
            group_ids_N,
            batch * groups,
            token_major=priority is None,  # BPR (not causal anyway): first choices first, as V-MoE's groups
            earlier_counts=earlier,
            valid=mask_N,
        )
        if state is not None:  # the counts of each sequence's last group, for the next call
            queue_NK = group_ids_N.unsqueeze(1) * num_experts + expert_ids_NK
            size = batch * groups * num_experts
            if mask_N is not None:
                queue_NK = torch.where(mask_N.unsqueeze(1), queue_NK, size)
            counts = count_ids(queue_NK, size + 1)[:size].view(batch, groups, num_experts)
            state.counts_BE = counts[:, -1] + (earlier[:, -1] if earlier is not None and groups == 1 else 0)
        return plan

    def forward(
        self,
        x: Tensor,
        token_ids: Tensor | None = None,
        start: int = 0,
        state: GroupCounts | None = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``."""
        self._check_input(x)
        B, T, D = x.shape
        mask_N = self._token_mask(padding_mask, B, T)
        x_ND = x.reshape(B * T, D)
        routing = self.router(x_ND, token_ids.reshape(-1) if token_ids is not None else None, mask_N)

        plan = self.plan(routing, B, T, start, state, mask_N)
        out_NO = apply_experts(self.experts, x_ND, plan, routing.gates)
        if self.shared_experts is not None:
            shared_NO = self.shared_experts(x_ND, x_ND.shape[0])
            if self.shared_expert_gate is not None:
                shared_NO = torch.sigmoid(self.shared_expert_gate(x_ND)) * shared_NO
            out_NO = out_NO + (shared_NO if mask_N is None else shared_NO * mask_N.unsqueeze(1))

        self._record(
            routing.aux_losses,
            lambda: self._stats_of(routing, plan, mask_N),
            B * T,
            routing.logit_checksum,
            lambda: torch.zeros(B * T, self.num_experts, device=x.device).scatter_add_(
                1, routing.expert_ids, plan.keep.float()
            ),  # [N, E]: the kept assignments
        )
        return out_NO.view(B, T, -1)

    def _stats_of(self, routing: Routing, plan: DispatchPlan, mask_N: Tensor | None) -> dict[str, Tensor]:
        probs = routing.probs
        if probs is None:  # hash routing: the distribution is the one-hot choice
            probs = torch.zeros(routing.expert_ids.shape[0], self.num_experts, device=routing.expert_ids.device)
            probs.scatter_(1, routing.expert_ids, 1.0)
        return tokens_choice_stats(probs.detach(), plan.counts, routing.gates.detach(), plan.keep, mask_N)

    def balancing_step(self) -> None:
        self.router.balancing_step()

    def discard_balancing_step(self) -> None:
        self.router.discard_balancing_step()

    def extra_repr(self) -> str:
        c = self.capacity
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, capacity_factor={c.capacity_factor}, "
            f"eval_capacity_factor={c.eval_capacity_factor}, capacity_scope={c.capacity_scope!r}, "
            f"batch_priority={c.batch_priority}"
        )


@register_moe_layer("top_k")
class TopKMoE(TokensChoiceMoE):
    """Tokens-choice top-k MoE: Switch, GShard, Mixtral, Shazeer's noisy top-k, V-MoE, DeepSeekMoE.

    Settings: the router's (:class:`~moekit.moe.routers.TopKRouter`: ``num_experts``, ``top_k``,
    ``score_func``, ``normalize_gates``, ``noisy_gating``, ``noise_std``, ``importance_over``,
    ``bias_update_rate``, the loss weights), the experts' (:class:`~moekit.moe.experts.ExpertsConfig`),
    capacity (:class:`~moekit.moe.capacity.Capacity`) and :class:`SharedExperts`. The papers' settings are
    the recipes of :mod:`moekit.recipes` (``switch``, ``top2``, ``vmoe``, ``mixtral``, ``deepseek``,
    ``noisy_top_k``).
    """

    Router = TopKRouter
    configs = (TopKRouter.Config, ExpertsConfig, Capacity, SharedExperts)


@register_moe_layer("hash")
class HashMoE(TokensChoiceMoE):
    """Hash layer (Roller et al. 2021): token id ``t`` always goes to expert ``hash(t)``, gate 1.

    ``forward(x, token_ids)`` needs the ``[batch, tokens]`` ids of the input tokens (so it serves language
    models, not a timm ``Block``, which passes none); ``vocab_size`` bounds them. The routing is fixed and
    per token, so the layer is causal. Settings: :class:`~moekit.moe.hash_routing.HashRouter`'s (``num_experts``,
    ``vocab_size``, ``hash_method`` - random, modulo, frequency-balanced or clustered - and ``hash_seed``), the
    experts' and :class:`SharedExperts`.
    """

    Router = HashRouter
    configs = (HashRouter.Config, ExpertsConfig, SharedExperts)


@register_moe_layer("base")
class BaseMoE(TokensChoiceMoE):
    """BASE layer (Lewis et al. 2021): balanced assignment in training (each expert gets exactly
    ``tokens / E`` tokens, ±1 when ``E`` does not divide the token count), greedy top-1 at inference,
    output ``sigmoid(affinity) * expert(x)``. See :class:`~moekit.moe.routers.BalancedRouter`.
    Settings: ``num_experts``, the experts' and :class:`SharedExperts`."""

    Router = BalancedRouter
    configs = (BalancedRouter.Config, ExpertsConfig, SharedExperts)

    @property
    def causal_safe(self) -> bool:
        return False  # the balanced assignment of a token depends on every other token


@register_moe_layer("hierarchical")
class HierarchicalMoE(TokensChoiceMoE):
    """Hierarchical MoE (Shazeer et al. 2017, appendix B): ``num_experts`` in ``num_groups`` groups, a primary
    noisy top-``top_k_groups`` gate over groups and a secondary noisy top-``top_k`` gate inside each chosen
    group (``top_k_groups * top_k`` experts per token). Settings: the router's
    (:class:`~moekit.moe.hierarchical_routing.HierarchicalRouter`), the experts' and capacity."""

    Router = HierarchicalRouter
    configs = (HierarchicalRouter.Config, ExpertsConfig, Capacity)
