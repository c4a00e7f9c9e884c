"""Routers for tokens-choice layers: each maps tokens ``x: [N, d]`` to ``k`` experts per token. Here the top-k
router (Switch, GShard, Mixtral, noisy top-k, V-MoE, DeepSeek) and BASE layers' balanced router; hash routing is
in :mod:`moekit.moe.hash_routing`, Shazeer's hierarchical gating in :mod:`moekit.moe.hierarchical_routing`.

Each router is built from its own small config dataclass (``TopKRouter.Config``, ...), whose fields are
settings of the layers in :mod:`moekit.moe.tokens_choice`. All routers compute in float32, also under
autocast. Each returns a :class:`Routing`; the layers turn it into capacity, dispatch and combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .assignment import Solver, balanced_assignment, balanced_capacities, resolve_solver
from .expert_dropping import OverpoweringExperts, check_margin
from .losses import (
    bengio_batchwise_loss,
    bengio_examplewise_loss,
    bengio_variance_loss,
    importance_loss,
    load_loss,
    router_z_loss,
    switch_load_balancing_loss,
    switch_loss_from_fractions,
    vmoe_load_loss,
)
from .routing import (
    Router,
    Routing,
    check_loss_weights,
    check_router_init,
    check_top_k,
    count_ids,
    expert_softmax,
    logit_checksum,
    recomputing,
    reset_own_parameters,
    router_logits,
    router_precision,
    router_weight,
)

__all__ = ["TopKRouter", "BalancedRouter"]


class TopKRouter(Router):
    """Tokens-choice top-k gating.

    ``scores = softmax(x W_g^T)`` over experts (or ``sigmoid``, DeepSeek-V3), the ``k`` best experts
    are chosen, and their scores are the gates; ``normalize_gates`` divides them by their sum
    (GShard/Mixtral top-2). ``k = 1`` without normalisation is the Switch router.

    Noise on the logits in training, for exploration and the load loss (one kind at a time):

    * learned (Shazeer et al. 2017, ``noisy_gating=True``): ``H = x W_g + eps * softplus(x W_noise)``,
      ``eps ~ N(0, 1)``; ``W_noise`` starts at zero;
    * fixed (V-MoE, ``noise_std > 0``): ``H = x W_g + eps * noise_std / E``; choice and gates come from
      ``softmax(H)``.

    Loss-free balancing (Wang et al. 2024, DeepSeek-V3; ``bias_update_rate > 0``): a per-expert bias
    ``b`` is added to the scores for the *choice* of experts only (gates use the unbiased scores).
    Token counts accumulate during forwards; :meth:`balancing_step` applies
    ``b_i += rate * sign(mean load - load_i)`` and is called once per optimizer step. The biases and counts stay
    float32 in a layer cast to bf16 / fp16 (:class:`~moekit.moe.routing.Float32State`).

    Router jitter (Switch, ``jitter_eps > 0``): in training the router's input is multiplied by noise drawn
    uniformly from ``[1 - eps, 1 + eps]`` (the experts see the clean input). ``router_init="zeros"`` starts
    ``W_g`` at zero (Shazeer et al. 2017, appendix A: "no signal and some noise" with learned noise).

    Dropping overpowering experts (Eigen et al. 2013, ``overpower_margin``): in training an expert whose running
    total of received gate mass is more than the margin ahead of the mean is left out of the choice for the
    step (softmax scores are renormalised over the others; :mod:`moekit.moe.expert_dropping`). Where fewer than ``k``
    experts are left, a token's remaining choices are dropped experts with gate 0 (still dispatched and counted).

    Balancing that does not depend on the parallel layout (``switch_loss_scope="global_batch"``): the Switch
    loss's assignment fractions ``f`` are those of the previous optimizer step's whole batch - token counts
    summed over the micro-batches of gradient accumulation and over the ranks in :meth:`balancing_step` - so
    that, ``P`` being a mean, the loss and its gradient are the same for any split of a batch into processes
    and micro-batches (the first step, with no counts yet, uses ``f = 1/E``: no pull). The default,
    ``"micro_batch"``, counts ``f`` in each forward, as the paper and most code do.

    Auxiliary losses, each on when its weight is non-zero: ``switch`` (Fedus et al.), ``importance``
    (``CV^2`` of the summed gates: over the sparse gates, Shazeer's, or with ``importance_over="probs"``
    over the clean softmax of all experts, V-MoE's), ``load`` (needs noise: Shazeer's estimator with
    learned noise, V-MoE's with fixed noise; :mod:`moekit.moe.losses`), ``z`` (ST-MoE router z-loss), and
    Bengio et al. 2015's ``bengio_batchwise``, ``bengio_examplewise`` and ``bengio_variance`` on the scores,
    towards the rate ``bengio_target`` (default: ``top_k / E`` of sigmoid scores, ``1 / E`` of softmax ones).
    """

    @dataclass(kw_only=True)
    class Config:
        num_experts: int = 8
        top_k: int = 2
        score_func: Literal["softmax", "sigmoid"] = "softmax"
        normalize_gates: bool = False
        noisy_gating: bool = False
        noise_std: float = 0.0
        importance_over: Literal["gates", "probs"] = "gates"
        bias_update_rate: float = 0.0
        switch_loss_scope: Literal["micro_batch", "global_batch"] = "micro_batch"
        jitter_eps: float = 0.0
        router_init: Literal["default", "zeros"] = "default"
        overpower_margin: float | None = None
        switch_loss_weight: float = 0.0
        importance_loss_weight: float = 0.0
        load_loss_weight: float = 0.0
        z_loss_weight: float = 0.0
        bengio_batchwise_loss_weight: float = 0.0
        bengio_examplewise_loss_weight: float = 0.0
        bengio_variance_loss_weight: float = 0.0
        bengio_target: float | None = None

        def __post_init__(self) -> None:
            check_top_k(self.num_experts, self.top_k)
            check_router_init(self.router_init)
            if not (isinstance(self.jitter_eps, (int, float)) and 0 <= self.jitter_eps < 1):
                raise ValueError(
                    f"jitter_eps={self.jitter_eps!r} must lie in [0, 1) (the router input is scaled by U[1-eps, 1+eps])"
                )
            if self.score_func not in ("softmax", "sigmoid"):
                raise ValueError(f"score_func={self.score_func!r}; allowed: 'softmax', 'sigmoid'")
            check_margin(self.overpower_margin)
            self._check_bengio()
            if self.switch_loss_scope not in ("micro_batch", "global_batch"):
                raise ValueError(
                    f"switch_loss_scope={self.switch_loss_scope!r}; allowed: 'micro_batch', 'global_batch'"
                )
            if self.switch_loss_scope == "global_batch" and not self.switch_loss_weight:
                raise ValueError(
                    "switch_loss_scope='global_batch' changes the Switch loss, which is off (switch_loss_weight=0); "
                    "set switch_loss_weight > 0 (e.g. 0.01)"
                )
            if self.importance_over not in ("gates", "probs"):
                raise ValueError(f"importance_over={self.importance_over!r}; allowed: 'gates', 'probs'")
            check_loss_weights(
                noise_std=self.noise_std,
                bias_update_rate=self.bias_update_rate,
                switch_loss_weight=self.switch_loss_weight,
                importance_loss_weight=self.importance_loss_weight,
                load_loss_weight=self.load_loss_weight,
                z_loss_weight=self.z_loss_weight,
            )
            if self.noisy_gating and self.noise_std:
                raise ValueError(
                    f"noisy_gating=True (learned noise, Shazeer) and noise_std={self.noise_std} (fixed noise, "
                    "V-MoE) both set; choose one"
                )
            if self.load_loss_weight and not (self.noisy_gating or self.noise_std):
                raise ValueError(
                    f"load_loss_weight={self.load_loss_weight} needs noise on the logits (noisy_gating=True "
                    "or noise_std > 0): the load estimator is defined through it; use importance_loss_weight or "
                    "switch_loss_weight instead"
                )

        def _check_bengio(self) -> None:
            check_loss_weights(
                bengio_batchwise_loss_weight=self.bengio_batchwise_loss_weight,
                bengio_examplewise_loss_weight=self.bengio_examplewise_loss_weight,
                bengio_variance_loss_weight=self.bengio_variance_loss_weight,
            )
            softmax = self.score_func == "softmax"
            if softmax and self.bengio_examplewise_loss_weight:
                raise ValueError(
                    f"bengio_examplewise_loss_weight={self.bengio_examplewise_loss_weight}: softmax scores sum to 1 "
                    "over the experts, so the examplewise loss is a constant; use score_func=sigmoid (independent "
                    "expert probabilities, as in Bengio et al.) or set the weight to 0"
                )
            uniform = 1.0 / self.num_experts
            if self.bengio_target is None:
                self.bengio_target = uniform if softmax else self.top_k / self.num_experts
            elif not 0 < self.bengio_target < 1 or (softmax and abs(self.bengio_target - uniform) > 1e-12):
                allowed = f"1/num_experts = {uniform:g} with softmax scores" if softmax else "in (0, 1)"
                raise ValueError(f"bengio_target={self.bengio_target!r} must be {allowed}; null picks it")

    def __init__(self, in_features: int, config: Config, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.weight = router_weight(config.num_experts, in_features, device, dtype)
        if config.router_init == "zeros":
            nn.init.zeros_(self.weight)
        self.noise_weight = (
            nn.Parameter(torch.zeros(config.num_experts, in_features, device=device, dtype=dtype))
            if config.noisy_gating
            else None
        )
        self.overpowering = (
            None
            if config.overpower_margin is None
            else OverpoweringExperts(config.num_experts, config.overpower_margin, device=device)
        )
        global_switch = config.switch_loss_weight > 0 and config.switch_loss_scope == "global_batch"
        state = {"device": device, "dtype": torch.float32}  # whatever the default dtype (Float32State)
        uniform = torch.full((config.num_experts,), 1.0 / config.num_experts, **state)
        buffers = {
            "expert_bias": torch.zeros(config.num_experts, **state) if config.bias_update_rate > 0 else None,
            # f of the previous optimizer step's global batch
            "switch_fraction": uniform if global_switch else None,
            # token counts since the last optimizer step
            "pending_counts": (
                torch.zeros(config.num_experts, **state) if config.bias_update_rate > 0 or global_switch else None
            ),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The construction's state (:func:`~moekit.moe.routing.reset_own_parameters`): no balancing bias, no counts,
        uniform global-batch fractions."""
        reset_own_parameters(self, ("weight",), zeros=self.config.router_init == "zeros")
        for counts in (self.expert_bias, self.pending_counts):
            if counts is not None:
                counts.zero_()
        if self.switch_fraction is not None:
            self.switch_fraction.fill_(1.0 / self.num_experts)

    def _noisy_logits(self, clean: Tensor, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(logits, noise_std)``: the logits with this router's noise in training (std per entry, or None)."""
        cfg = self.config
        if not self.training:
            return clean, None
        if cfg.noisy_gating:
            noise_std = F.softplus(router_logits(x, self.noise_weight))
        elif cfg.noise_std:
            noise_std = torch.full_like(clean, cfg.noise_std / self.num_experts)
        else:
            return clean, None
        return clean + torch.randn_like(clean) * noise_std, noise_std

    def forward(self, x: Tensor, token_ids: Tensor | None = None, mask: Tensor | None = None) -> Routing:
        """``x: [N, d]`` -> :class:`Routing` with ``k`` experts per token; ``mask: [N]`` bool, the real tokens
        (padding is left out of the losses and the balancing counts)."""
        cfg = self.config
        if self.training and cfg.jitter_eps:
            x = router_precision(x)
            x = x * torch.empty_like(x).uniform_(1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
        clean_NE = router_logits(x, self.weight)
        logits_NE, noise_std = self._noisy_logits(clean_NE, x)
        if cfg.score_func == "softmax":
            scores_NE = expert_softmax(logits_NE)
            probs_NE = scores_NE
        else:
            scores_NE = torch.sigmoid(logits_NE)
            probs_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True)
        losses = self._score_losses(scores_NE, mask)
        dropping = self.overpowering if self.overpowering is not None and self.training else None  # eval: all kept
        if dropping is not None and cfg.score_func == "softmax":  # Eigen et al.: leave out the experts that ran ahead
            # the softmax over the kept experts' logits: the renormalised scores, also where the kept experts'
            # scores underflow next to a dropped expert's (scores / sum would be 0 / 0)
            scores_NE = expert_softmax(dropping.without_dropped(logits_NE))
        elif dropping is not None:
            scores_NE = scores_NE * dropping.keep_E()
        choice_NE = scores_NE if self.expert_bias is None else scores_NE + self.expert_bias
        if dropping is not None:  # a dropped expert is not chosen, whatever its balancing bias
            choice_NE = dropping.without_dropped(choice_NE)
        expert_ids_NK = choice_NE.topk(self.top_k, dim=-1).indices
        gates_NK = scores_NE.gather(1, expert_ids_NK)
        if cfg.normalize_gates:
            gates_NK = gates_NK / gates_NK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(gates_NK.dtype).tiny)
        real_N1 = None if mask is None else mask.unsqueeze(1)
        if self.overpowering is not None:
            mass_NK = gates_NK.detach() if real_N1 is None else gates_NK.detach() * real_N1
            self.overpowering.received(
                mass_NK.new_zeros(self.num_experts).index_add_(0, expert_ids_NK.reshape(-1), mass_NK.reshape(-1)),
                num_tokens=expert_ids_NK.shape[0] if mask is None else mask.sum(),
            )
        if self.pending_counts is not None and self.training and not recomputing():
            with torch.no_grad():
                counted_NK = expert_ids_NK if real_N1 is None else torch.where(real_N1, expert_ids_NK, self.num_experts)
                self.pending_counts += count_ids(counted_NK, self.num_experts + 1)[: self.num_experts].float()

        if cfg.switch_loss_weight and self.switch_fraction is not None:
            losses["switch"] = cfg.switch_loss_weight * switch_loss_from_fractions(probs_NE, self.switch_fraction, mask)
        elif cfg.switch_loss_weight:
            losses["switch"] = cfg.switch_loss_weight * switch_load_balancing_loss(
                probs_NE, expert_ids_NK, self.num_experts, mask
            )
        if cfg.importance_loss_weight:
            if cfg.importance_over == "probs":
                importance_of = expert_softmax(clean_NE)
            else:
                importance_of = torch.zeros_like(scores_NE).scatter(1, expert_ids_NK, gates_NK)
            losses["importance"] = cfg.importance_loss_weight * importance_loss(importance_of, mask)
        if cfg.load_loss_weight and noise_std is not None:
            load = load_loss if cfg.noisy_gating else vmoe_load_loss
            losses["load"] = cfg.load_loss_weight * load(clean_NE, logits_NE, noise_std, self.top_k, mask)
        if cfg.z_loss_weight:
            losses["z"] = cfg.z_loss_weight * router_z_loss(logits_NE, mask)
        return Routing(
            expert_ids_NK,
            gates_NK,
            probs_NE,
            priority=scores_NE.max(dim=-1).values,
            aux_losses=losses,
            logit_checksum=logit_checksum(logits_NE),
        )

    def _score_losses(self, scores_NE: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
        """Bengio et al.'s losses of the scores (before any expert is dropped), those with a non-zero weight."""
        cfg = self.config
        losses = {}
        if cfg.bengio_batchwise_loss_weight:
            loss = bengio_batchwise_loss(scores_NE, cfg.bengio_target, mask)
            losses["bengio_batchwise"] = cfg.bengio_batchwise_loss_weight * loss
        if cfg.bengio_examplewise_loss_weight:
            loss = bengio_examplewise_loss(scores_NE, cfg.bengio_target, mask)
            losses["bengio_examplewise"] = cfg.bengio_examplewise_loss_weight * loss
        if cfg.bengio_variance_loss_weight:
            losses["bengio_variance"] = cfg.bengio_variance_loss_weight * bengio_variance_loss(scores_NE, mask)
        return losses

    @torch.no_grad()
    def balancing_step(self) -> None:
        """From the token counts since the previous call, summed over ranks: the loss-free balancing update and
        the global-batch Switch fractions."""
        counts = self.pending_counts
        if counts is None:
            return
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        if self.expert_bias is not None:
            self.expert_bias += self.config.bias_update_rate * torch.sign(counts.mean() - counts)
        if self.switch_fraction is not None:
            total = counts.sum()
            fresh = counts / total.clamp_min(1.0)
            self.switch_fraction.copy_(torch.where(total > 0, fresh, self.switch_fraction))
        counts.zero_()

    @torch.no_grad()
    def discard_balancing_step(self) -> None:
        """Forget the token counts since the previous update without applying them (the optimizer
        step they belong to was skipped)."""
        if self.pending_counts is not None:
            self.pending_counts.zero_()


class BalancedRouter(Router):
    """BASE layer routing (Lewis et al. 2021).

    Affinities ``s = x W^T`` (one learned embedding per expert). In training, the assignment
    maximising the total affinity with every expert taking ``N / E`` tokens (±1 when ``E`` does not
    divide ``N``) is solved by :func:`balanced_assignment` (``solver``: ``"auto"`` takes the exact solver on CPUs,
    the sync-free one elsewhere; see :mod:`moekit.moe.assignment`); at inference each token takes its best
    expert. The gate is ``sigmoid(s[n, a(n)])``, the paper's residual weighting.
    """

    @dataclass(kw_only=True)
    class Config:
        num_experts: int = 8
        solver: Solver = "auto"

        def __post_init__(self) -> None:
            check_top_k(self.num_experts, 1)
            resolve_solver(self.solver, torch.device("cpu"))  # a clear error for an unknown name

    def __init__(self, in_features: int, config: Config, device=None, dtype=None) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.solver = config.solver
        self.top_k = 1
        self.weight = nn.Parameter(torch.empty(config.num_experts, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The expert embeddings orthogonal with gain 0.1, as the paper's code (fairseq's ``BaseLayer``) starts them:
        the affinities start small, the gates near 1/2."""
        if self.weight.is_meta:  # a layer measured on the meta device: no values, no random draws
            return
        weight = torch.empty(self.weight.shape, device=self.weight.device)  # float32: QR in any parameter dtype
        self.weight.copy_(nn.init.orthogonal_(weight, gain=0.1))

    def forward(self, x: Tensor, token_ids: Tensor | None = None, mask: Tensor | None = None) -> Routing:
        scores = router_logits(x, self.weight)
        if self.training:
            # Non-finite scores would keep the assignment's auction from ending: assign as if they were 0.
            # The gates below still carry them, so the loss is non-finite and NonFiniteGuard skips the step.
            finite = torch.nan_to_num(scores.detach(), nan=0.0, posinf=0.0, neginf=0.0)
            expert_ids = self._assign(finite, mask).unsqueeze(1)
        else:
            expert_ids = scores.argmax(dim=-1, keepdim=True)
        gates = torch.sigmoid(scores.gather(1, expert_ids))
        return Routing(expert_ids, gates, expert_softmax(scores), priority=None, logit_checksum=logit_checksum(scores))

    def _assign(self, scores_NE: Tensor, mask: Tensor | None) -> Tensor:
        """``[N]`` experts: the real tokens share the experts evenly; padding goes to expert 0 (the layer drops it)."""
        num_tokens, num_experts = scores_NE.shape
        solver = resolve_solver(self.solver, scores_NE.device)
        if mask is None:
            caps = balanced_capacities(num_tokens, num_experts, scores_NE.device)
            return balanced_assignment(scores_NE, caps, solver=solver)
        if solver == "exact":  # it reads the host anyway
            real = mask.nonzero().squeeze(1)
            caps = balanced_capacities(real.numel(), num_experts, scores_NE.device)
            expert_ids = torch.zeros(num_tokens, dtype=torch.long, device=scores_NE.device)
            expert_ids[real] = balanced_assignment(scores_NE[real], caps, solver=solver)
            return expert_ids
        # Without reading how many tokens are real: the padding fills an expert of its own, E, which every real
        # token values far below any other and every padding token far above.
        real = mask.sum()
        caps = torch.cat([balanced_capacities(real, num_experts), (num_tokens - real).view(1)])
        far = 4 * scores_NE.abs().amax() + 1
        real_rows = torch.cat([scores_NE, -far.expand(num_tokens, 1)], dim=1)  # [N, E + 1]
        padding_row = torch.cat([-far.expand(num_experts), far.view(1)])  # [E + 1]
        scores = torch.where(mask.unsqueeze(1), real_rows, padding_row)
        return torch.where(mask, balanced_assignment(scores, caps, solver=solver), 0)
