"""Tokens-choice MoE layers: every token picks ``k`` experts.

:class:`TokenChoiceMoE` holds the machinery shared by all of them - the expert bank, optional
always-on shared experts (DeepSeekMoE), expert capacity with Batch Prioritized Routing, dispatch and
combine, statistics. Subclasses only decide the routing:

* :class:`TopKMoE` - softmax/sigmoid top-k: Switch (k=1), GShard/Mixtral (k=2, renormalised), Shazeer's
  noisy top-k, DeepSeekMoE shared + fine-grained experts, loss-free balancing;
* :class:`HashMoE` - fixed token-id hash routing;
* :class:`BaseMoE` - BASE layers' balanced assignment;
* :class:`HierarchicalMoE` - Shazeer's two-level gating.

A token whose assignments are all dropped by capacity gets a zero output, so the block's residual
connection passes it through unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from .base import MlpSpec, MoELayer, register_moe_layer
from .dispatch import DispatchPlan, combine, dispatch, expert_capacity, plan_dispatch
from .experts import Kernel
from .routers import BalancedRouter, HashRouter, HierarchicalRouter, Routing, TopKRouter
from .stats import token_choice_stats

__all__ = ["TokenChoiceMoE", "TopKMoE", "HashMoE", "BaseMoE", "HierarchicalMoE"]

CapacityFactor = float | None
CapacityScope = Literal["batch", "position"]


def _check_capacity(value, name: str, layer: str) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(
            f"{layer}: {name}={value!r} must be a positive number, or None for no capacity limit (dropless)"
        )


class TokenChoiceMoE(MoELayer):
    """Base of tokens-choice layers. Subclasses build ``self.router`` and implement :meth:`route`.

    Args (shared by all subclasses, after the timm ``Mlp`` keywords):
        num_experts: routed experts ``E``.
        top_k: experts per token ``k``.
        capacity_factor: expert capacity ``C = ceil(k * tokens * capacity_factor / E)`` over all tokens
            of the forward; None = dropless.
        eval_capacity_factor: capacity factor in eval mode; ``"same"`` reuses ``capacity_factor``.
        capacity_scope: ``"batch"``: one capacity over all ``batch * tokens`` tokens (vision);
            ``"position"``: a capacity ``C = ceil(k * batch * capacity_factor / E)`` for each sequence
            position, over the ``batch`` tokens at that position. Then whether a token is dropped never
            depends on other positions: the layer is causal, and incremental decoding with a KV cache
            drops exactly what the full forward drops.
        batch_priority: Batch Prioritized Routing (Riquelme et al. 2021): when capacity binds, tokens
            with the highest top router score are served first instead of the earliest tokens.
        expert_hidden_features: hidden size of each routed expert (default: ``hidden_features``);
            fine-grained experts use ``hidden_features // m`` with ``m`` times more experts and ``k``.
        num_shared_experts: always-on experts of the same hidden size, applied to every token and
            added to the routed output (DeepSeekMoE); computed as one dense MLP.
        gated, expert_init, expert_init_std, kernel: see :class:`ExpertBank`.
    """

    router: nn.Module

    def __init__(
        self,
        spec: MlpSpec,
        *,
        num_experts: int,
        top_k: int,
        capacity_factor: CapacityFactor,
        eval_capacity_factor: CapacityFactor | Literal["same"],
        batch_priority: bool,
        expert_hidden_features: int | None,
        num_shared_experts: int,
        gated: bool,
        expert_init: str,
        expert_init_std: float | None,
        kernel: Kernel,
        compute_stats: bool,
        capacity_scope: CapacityScope = "batch",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(compute_stats)
        name = type(self).__name__
        if capacity_scope not in ("batch", "position"):
            raise ValueError(f"{name}: capacity_scope={capacity_scope!r}; allowed: 'batch', 'position'")
        _check_capacity(capacity_factor, "capacity_factor", name)
        if eval_capacity_factor != "same":
            _check_capacity(eval_capacity_factor, "eval_capacity_factor", name)
        if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"{name}: num_shared_experts={num_shared_experts!r} must be an int >= 0")
        expert_hidden = expert_hidden_features or spec.hidden_features
        if not isinstance(expert_hidden, int) or expert_hidden < 1:
            raise ValueError(f"{name}: expert_hidden_features={expert_hidden_features!r} must be a positive int")
        self.in_features = spec.in_features
        self.out_features = spec.out_features
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = capacity_factor if eval_capacity_factor == "same" else eval_capacity_factor
        self.batch_priority = batch_priority
        self.capacity_scope = capacity_scope
        bank_options = dict(
            gated=gated, init=expert_init, init_std=expert_init_std, kernel=kernel, device=device, dtype=dtype
        )
        self.experts = spec.expert_bank(num_experts, expert_hidden, **bank_options)
        self.shared_experts = (
            spec.expert_bank(1, num_shared_experts * expert_hidden, **bank_options) if num_shared_experts else None
        )

    @property
    def causal_safe(self) -> bool:
        dropless = self.capacity_factor is None and self.eval_capacity_factor is None
        return dropless or self.capacity_scope == "position"

    def expert_rows_per_token(self, num_tokens: int) -> float:
        # With a per-position capacity the drops depend on the batch size, not on num_tokens: report k.
        capacity = self.capacity(num_tokens) if self.capacity_scope == "batch" else None
        routed = self.top_k if capacity is None else min(self.top_k, capacity * self.num_experts / num_tokens)
        shared = self.shared_experts.hidden_features / self.experts.hidden_features if self.shared_experts else 0.0
        return routed + shared

    def route(self, x: Tensor, token_ids: Tensor | None) -> Routing:
        """``x: [N, d]`` (and ``token_ids: [N]`` for hash routing) -> :class:`Routing`."""
        raise NotImplementedError

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments each expert may take from ``num_tokens`` competing tokens (None: dropless)."""
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return None if factor is None else expert_capacity(num_tokens, self.top_k, self.num_experts, factor)

    def plan(self, routing: Routing, batch: int, tokens: int) -> DispatchPlan:
        """Apply capacity (and Batch Prioritized Routing) to the routing of ``batch * tokens`` tokens
        (flattened batch-major)."""
        priority = routing.priority if self.batch_priority else None
        if self.capacity_scope == "batch":
            return plan_dispatch(routing.expert_ids, self.num_experts, self.capacity(batch * tokens), priority)
        positions = torch.arange(tokens, device=routing.expert_ids.device).repeat(batch)
        return plan_dispatch(
            routing.expert_ids, self.num_experts, self.capacity(batch), priority, group_ids=positions, num_groups=tokens
        )

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """``x: [batch, tokens, in_features]`` -> ``[batch, tokens, out_features]``.

        ``token_ids: [batch, tokens]`` long is needed by :class:`HashMoE` only.
        """
        self._check_input(x, self.in_features, type(self).__name__)
        batch, tokens, dim = x.shape
        x_flat = x.reshape(batch * tokens, dim)
        routing = self.route(x_flat, token_ids.reshape(-1) if token_ids is not None else None)

        plan = self.plan(routing, batch, tokens)
        expert_out = self.experts(dispatch(x_flat, plan), plan.counts)
        out = combine(expert_out, plan, routing.gates)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_flat, x_flat.shape[0])

        self._record(routing.aux_losses, lambda: self._stats_of(routing, plan), batch * tokens, routing.logit_checksum)
        return out.view(batch, tokens, -1)

    def _stats_of(self, routing: Routing, plan: DispatchPlan) -> dict[str, Tensor]:
        probs = routing.probs
        if probs is None:  # hash routing: the distribution is the one-hot choice
            probs = torch.zeros(routing.expert_ids.shape[0], self.num_experts, device=routing.expert_ids.device)
            probs.scatter_(1, routing.expert_ids, 1.0)
        return token_choice_stats(probs.detach(), plan.counts, routing.gates.detach(), plan.keep)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
            f"eval_capacity_factor={self.eval_capacity_factor}, capacity_scope={self.capacity_scope!r}, "
            f"batch_priority={self.batch_priority}"
        )


def _mlp_spec(name, in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv):
    return MlpSpec.from_mlp_kwargs(
        in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv, name
    )


@register_moe_layer("top_k")
class TopKMoE(TokenChoiceMoE):
    """Tokens-choice top-k MoE (Switch, GShard, Mixtral, Shazeer's noisy top-k, DeepSeekMoE).

    Recipes:

    * Switch Transformer: ``top_k=1, capacity_factor=1.25, switch_loss_weight=0.01``;
    * V-MoE: ``top_k=2, capacity_factor=1.05, batch_priority=True, importance_loss_weight=..``;
    * Mixtral: ``top_k=2, normalize_gates=True, gated=True, act_layer=nn.SiLU`` (dropless);
    * Shazeer 2017: ``noisy_gating=True, normalize_gates=True, importance_loss_weight=0.1,
      load_loss_weight=0.1``;
    * DeepSeekMoE: ``num_shared_experts=2, expert_hidden_features=hidden // 4, num_experts=64, top_k=6``;
      DeepSeek-V3 routing adds ``score_func="sigmoid", normalize_gates=True, bias_update_rate=1e-3``.

    Router keywords (``score_func``, ``normalize_gates``, ``noisy_gating``, ``bias_update_rate`` and
    the loss weights) are documented in :class:`~moekit.moe.routers.TopKRouter`; capacity, shared
    experts and expert keywords in :class:`TokenChoiceMoE`.
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
        top_k: int = 2,
        capacity_factor: CapacityFactor = None,
        eval_capacity_factor: CapacityFactor | Literal["same"] = "same",
        capacity_scope: CapacityScope = "batch",
        batch_priority: bool = False,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        normalize_gates: bool = False,
        noisy_gating: bool = False,
        bias_update_rate: float = 0.0,
        switch_loss_weight: float = 0.0,
        importance_loss_weight: float = 0.0,
        load_loss_weight: float = 0.0,
        z_loss_weight: float = 0.0,
        expert_hidden_features: int | None = None,
        num_shared_experts: int = 0,
        gated: bool = False,
        expert_init: str = "independent",
        expert_init_std: float | None = None,
        kernel: Kernel = "auto",
        compute_stats: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        spec = _mlp_spec(
            "TopKMoE", in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv
        )
        router = TopKRouter(
            spec.in_features,
            num_experts,
            top_k,
            score_func=score_func,
            normalize_gates=normalize_gates,
            noisy_gating=noisy_gating,
            bias_update_rate=bias_update_rate,
            switch_loss_weight=switch_loss_weight,
            importance_loss_weight=importance_loss_weight,
            load_loss_weight=load_loss_weight,
            z_loss_weight=z_loss_weight,
            device=device,
            dtype=dtype,
        )
        super().__init__(
            spec,
            num_experts=num_experts,
            top_k=top_k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            capacity_scope=capacity_scope,
            batch_priority=batch_priority,
            expert_hidden_features=expert_hidden_features,
            num_shared_experts=num_shared_experts,
            gated=gated,
            expert_init=expert_init,
            expert_init_std=expert_init_std,
            kernel=kernel,
            compute_stats=compute_stats,
            device=device,
            dtype=dtype,
        )
        self.router = router

    def route(self, x: Tensor, token_ids: Tensor | None) -> Routing:
        return self.router(x)

    def balancing_step(self) -> None:
        self.router.balancing_step()

    def discard_balancing_step(self) -> None:
        self.router.discard_balancing_step()

    @torch.no_grad()
    def load_dense_mlp(self, mlp: nn.Module, noise_std: float = 0.0) -> None:
        """Sparse upcycling: every routed expert becomes a copy of ``mlp`` (see
        :meth:`ExpertBank.load_dense_mlp`)."""
        self.experts.load_dense_mlp(mlp, noise_std)


@register_moe_layer("hash")
class HashMoE(TokenChoiceMoE):
    """Hash layer (Roller et al. 2021): token id ``t`` always goes to expert ``hash(t)``, gate 1.

    ``forward(x, token_ids)`` needs the ``[batch, tokens]`` ids of the input tokens; ``vocab_size``
    bounds them. The routing is fixed and per token, so the layer is causal.
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
        vocab_size: int,
        hash_seed: int = 0,
        expert_hidden_features: int | None = None,
        num_shared_experts: int = 0,
        gated: bool = False,
        expert_init: str = "independent",
        expert_init_std: float | None = None,
        kernel: Kernel = "auto",
        compute_stats: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        spec = _mlp_spec(
            "HashMoE", in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv
        )
        router = HashRouter(num_experts, vocab_size, seed=hash_seed, device=device)
        super().__init__(
            spec,
            num_experts=num_experts,
            top_k=1,
            capacity_factor=None,
            eval_capacity_factor=None,
            batch_priority=False,
            expert_hidden_features=expert_hidden_features,
            num_shared_experts=num_shared_experts,
            gated=gated,
            expert_init=expert_init,
            expert_init_std=expert_init_std,
            kernel=kernel,
            compute_stats=compute_stats,
            device=device,
            dtype=dtype,
        )
        self.router = router

    def route(self, x: Tensor, token_ids: Tensor | None) -> Routing:
        if token_ids is None:
            raise ValueError(
                "HashMoE needs the token ids: call it as layer(x, token_ids=ids) with ids of shape [batch, tokens] "
                "(hash routing maps each token id to a fixed expert)"
            )
        if token_ids.numel() != x.shape[0]:
            raise ValueError(
                f"HashMoE: token_ids hold {token_ids.numel()} ids for {x.shape[0]} tokens; pass [batch, tokens] ids "
                "matching x"
            )
        return self.router(token_ids)


@register_moe_layer("base")
class BaseMoE(TokenChoiceMoE):
    """BASE layer (Lewis et al. 2021): balanced assignment in training (each expert gets exactly
    ``tokens / E`` tokens, ±1 when ``E`` does not divide the token count), greedy top-1 at inference,
    output ``sigmoid(affinity) * expert(x)``. See :class:`~moekit.moe.routers.BalancedRouter`."""

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
        expert_hidden_features: int | None = None,
        num_shared_experts: int = 0,
        gated: bool = False,
        expert_init: str = "independent",
        expert_init_std: float | None = None,
        kernel: Kernel = "auto",
        compute_stats: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        spec = _mlp_spec(
            "BaseMoE", in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv
        )
        router = BalancedRouter(spec.in_features, num_experts, device=device, dtype=dtype)
        super().__init__(
            spec,
            num_experts=num_experts,
            top_k=1,
            capacity_factor=None,
            eval_capacity_factor=None,
            batch_priority=False,
            expert_hidden_features=expert_hidden_features,
            num_shared_experts=num_shared_experts,
            gated=gated,
            expert_init=expert_init,
            expert_init_std=expert_init_std,
            kernel=kernel,
            compute_stats=compute_stats,
            device=device,
            dtype=dtype,
        )
        self.router = router

    @property
    def causal_safe(self) -> bool:
        return False  # the balanced assignment of a token depends on every other token

    def route(self, x: Tensor, token_ids: Tensor | None) -> Routing:
        return self.router(x)


@register_moe_layer("hierarchical")
class HierarchicalMoE(TokenChoiceMoE):
    """Hierarchical MoE (Shazeer et al. 2017, appendix B): ``num_groups * experts_per_group`` experts,
    a primary noisy top-``top_k_groups`` gate over groups and a secondary noisy top-``top_k`` gate inside
    each chosen group (``top_k_groups * top_k`` experts per token). See
    :class:`~moekit.moe.routers.HierarchicalRouter`."""

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
        num_groups: int = 4,
        experts_per_group: int = 4,
        top_k_groups: int = 1,
        top_k: int = 2,
        noisy_gating: bool = True,
        importance_loss_weight: float = 0.0,
        load_loss_weight: float = 0.0,
        capacity_factor: CapacityFactor = None,
        eval_capacity_factor: CapacityFactor | Literal["same"] = "same",
        capacity_scope: CapacityScope = "batch",
        batch_priority: bool = False,
        expert_hidden_features: int | None = None,
        gated: bool = False,
        expert_init: str = "independent",
        expert_init_std: float | None = None,
        kernel: Kernel = "auto",
        compute_stats: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        spec = _mlp_spec(
            "HierarchicalMoE", in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv
        )
        router = HierarchicalRouter(
            spec.in_features,
            num_groups,
            experts_per_group,
            top_k_groups=top_k_groups,
            top_k=top_k,
            noisy_gating=noisy_gating,
            importance_loss_weight=importance_loss_weight,
            load_loss_weight=load_loss_weight,
            device=device,
            dtype=dtype,
        )
        super().__init__(
            spec,
            num_experts=num_groups * experts_per_group,
            top_k=top_k_groups * top_k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            capacity_scope=capacity_scope,
            batch_priority=batch_priority,
            expert_hidden_features=expert_hidden_features,
            num_shared_experts=0,
            gated=gated,
            expert_init=expert_init,
            expert_init_std=expert_init_std,
            kernel=kernel,
            compute_stats=compute_stats,
            device=device,
            dtype=dtype,
        )
        self.router = router

    def route(self, x: Tensor, token_ids: Tensor | None) -> Routing:
        return self.router(x)
