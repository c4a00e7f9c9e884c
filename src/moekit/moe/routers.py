"""Routers for tokens-choice layers: each maps tokens ``x: [N, d]`` to ``k`` experts per token.

Each router is built from its own small config dataclass (``TopKRouter.Config``, ...), whose fields are
settings of the layers in :mod:`moekit.moe.tokens_choice`. All routers compute in float32, also under
autocast. Each returns a :class:`Routing`; the layers turn it into capacity, dispatch and combine.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .assignment import balanced_assignment, balanced_capacities
from .expert_dropping import OverpoweringExperts, check_margin
from .losses import (
    bengio_batchwise_loss,
    bengio_examplewise_loss,
    bengio_variance_loss,
    cv_squared,
    importance_loss,
    load_loss,
    load_probabilities,
    router_z_loss,
    smooth_load,
    switch_load_balancing_loss,
    switch_loss_from_fractions,
    vmoe_load_loss,
)
from .routing import Router, Routing, logit_checksum, router_logits, router_precision, router_weight

__all__ = ["TopKRouter", "HashRouter", "BalancedRouter", "HierarchicalRouter"]


def _check_k(num_experts: int, top_k: int, what: str = "top_k") -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive int")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{what}={top_k!r} must be an int in [1, {num_experts}]")


def _check_init(router_init: str) -> None:
    if router_init not in ("default", "zeros"):
        raise ValueError(f"router_init={router_init!r}; allowed: 'default', 'zeros'")


def _check_weights(**weights: float) -> None:
    for name, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0 (0 turns it off)")


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
    ``b_i += rate * sign(mean load - load_i)`` and is called once per optimizer step.

    Router jitter (Switch, ``jitter_eps > 0``): in training the router's input is multiplied by noise drawn
    uniformly from ``[1 - eps, 1 + eps]`` (the experts see the clean input). ``router_init="zeros"`` starts
    ``W_g`` at zero (Shazeer et al. 2017, appendix A: "no signal and some noise" with learned noise).

    Dropping overpowering experts (Eigen et al. 2013, ``overpower_margin``): in training an expert whose running
    total of received gate mass is more than the margin ahead of the mean is left out of the choice for the
    step (softmax scores are renormalised over the others; :mod:`moekit.moe.expert_dropping`).

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
            _check_k(self.num_experts, self.top_k)
            _check_init(self.router_init)
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
            _check_weights(
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
            _check_weights(
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
        uniform = torch.full((config.num_experts,), 1.0 / config.num_experts, device=device)
        buffers = {
            "expert_bias": torch.zeros(config.num_experts, device=device) if config.bias_update_rate > 0 else None,
            # f of the previous optimizer step's global batch
            "switch_fraction": uniform if global_switch else None,
            # token counts since the last optimizer step
            "pending_counts": (
                torch.zeros(config.num_experts, device=device) if config.bias_update_rate > 0 or global_switch else None
            ),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value)

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

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Routing:
        """``x: [N, d]`` -> :class:`Routing` with ``k`` experts per token."""
        cfg = self.config
        if self.training and cfg.jitter_eps:
            x = router_precision(x)
            x = x * torch.empty_like(x).uniform_(1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
        clean_NE = router_logits(x, self.weight)
        logits_NE, noise_std = self._noisy_logits(clean_NE, x)
        if cfg.score_func == "softmax":
            scores_NE = torch.softmax(logits_NE, dim=-1)
            probs_NE = scores_NE
        else:
            scores_NE = torch.sigmoid(logits_NE)
            probs_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True)
        losses = self._score_losses(scores_NE)
        if self.overpowering is not None:  # Eigen et al.: leave out the experts that ran ahead
            scores_NE = scores_NE * self.overpowering.keep_E()
            if cfg.score_func == "softmax":
                scores_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True)
        choice_NE = scores_NE if self.expert_bias is None else scores_NE + self.expert_bias
        expert_ids_NK = choice_NE.topk(self.top_k, dim=-1).indices
        gates_NK = scores_NE.gather(1, expert_ids_NK)
        if cfg.normalize_gates:
            gates_NK = gates_NK / gates_NK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(gates_NK.dtype).tiny)
        if self.overpowering is not None:
            self.overpowering.received(
                torch.zeros_like(self.overpowering.gate_mass_total).index_add_(
                    0, expert_ids_NK.reshape(-1), gates_NK.detach().reshape(-1)
                ),
                num_tokens=expert_ids_NK.shape[0],
            )
        if self.pending_counts is not None and self.training:
            with torch.no_grad():
                self.pending_counts += torch.bincount(expert_ids_NK.reshape(-1), minlength=self.num_experts).float()

        if cfg.switch_loss_weight and self.switch_fraction is not None:
            losses["switch"] = cfg.switch_loss_weight * switch_loss_from_fractions(probs_NE, self.switch_fraction)
        elif cfg.switch_loss_weight:
            losses["switch"] = cfg.switch_loss_weight * switch_load_balancing_loss(
                probs_NE, expert_ids_NK, self.num_experts
            )
        if cfg.importance_loss_weight:
            if cfg.importance_over == "probs":
                importance_of = torch.softmax(clean_NE, dim=-1)
            else:
                importance_of = torch.zeros_like(scores_NE).scatter(1, expert_ids_NK, gates_NK)
            losses["importance"] = cfg.importance_loss_weight * importance_loss(importance_of)
        if cfg.load_loss_weight and noise_std is not None:
            load = load_loss if cfg.noisy_gating else vmoe_load_loss
            losses["load"] = cfg.load_loss_weight * load(clean_NE, logits_NE, noise_std, self.top_k)
        if cfg.z_loss_weight:
            losses["z"] = cfg.z_loss_weight * router_z_loss(logits_NE)
        return Routing(
            expert_ids_NK,
            gates_NK,
            probs_NE,
            priority=scores_NE.max(dim=-1).values,
            aux_losses=losses,
            logit_checksum=logit_checksum(logits_NE),
        )

    def _score_losses(self, scores_NE: Tensor) -> dict[str, Tensor]:
        """Bengio et al.'s losses of the scores (before any expert is dropped), those with a non-zero weight."""
        cfg = self.config
        losses = {}
        if cfg.bengio_batchwise_loss_weight:
            loss = bengio_batchwise_loss(scores_NE, cfg.bengio_target)
            losses["bengio_batchwise"] = cfg.bengio_batchwise_loss_weight * loss
        if cfg.bengio_examplewise_loss_weight:
            loss = bengio_examplewise_loss(scores_NE, cfg.bengio_target)
            losses["bengio_examplewise"] = cfg.bengio_examplewise_loss_weight * loss
        if cfg.bengio_variance_loss_weight:
            losses["bengio_variance"] = cfg.bengio_variance_loss_weight * bengio_variance_loss(scores_NE)
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


class HashRouter(Router):
    """Hash routing (Roller et al. 2021): a fixed map token id -> expert, gate 1. No parameters are learned.

    The map (``hash_method``) over the ``vocab_size`` ids:

    * ``"random"``: a random permutation (seed ``hash_seed``) cut into ``num_experts`` groups of (nearly) equal
      size - the paper's random hash, balanced over the vocabulary;
    * ``"modulo"``: ``id mod num_experts``;
    * ``"frequency"``: balanced over the *tokens* of a corpus rather than over the vocabulary: ids in decreasing
      order of their count go, one at a time, to the expert with the smallest total count so far (the paper's
      "balanced assignment" by token frequency); :meth:`fit_frequency` takes the counts;
    * ``"clustered"``: k-means of the token embeddings, one cluster per expert (the paper's clustered hash, on the
      embeddings of a trained model); :meth:`fit_clusters` takes the embeddings.

    ``frequency`` and ``clustered`` routers must be fitted before they route
    (:func:`moekit.models.fit_hash_routing`; the training template fits them from the training split or the
    model's token embeddings when training starts). The table is a buffer, saved with the model.
    """

    needs_token_ids = True

    @dataclass(kw_only=True)
    class Config:
        num_experts: int = 8
        vocab_size: int | None = None
        hash_method: Literal["random", "modulo", "frequency", "clustered"] = "random"
        hash_seed: int = 0

        def __post_init__(self) -> None:
            _check_k(self.num_experts, 1)
            if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
                raise ValueError(
                    f"vocab_size={self.vocab_size!r} must be a positive int (the token vocabulary; "
                    "the language models set it)"
                )
            if self.hash_method not in HASH_METHODS:
                raise ValueError(f"hash_method={self.hash_method!r}; allowed: {', '.join(map(repr, HASH_METHODS))}")

    def __init__(self, in_features: int, config: Config, device=None, dtype=None) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = 1
        self.vocab_size = config.vocab_size
        self.hash_method = config.hash_method
        self.hash_seed = config.hash_seed
        ids = torch.arange(config.vocab_size)
        if config.hash_method == "modulo":
            table = ids % config.num_experts
        else:  # random, and the starting table of the fitted methods
            generator = torch.Generator().manual_seed(config.hash_seed)
            table = torch.empty(config.vocab_size, dtype=torch.long)
            table[torch.randperm(config.vocab_size, generator=generator)] = ids % config.num_experts
        self.register_buffer("expert_of_token", table.to(device))
        self.register_buffer("table_fitted", torch.tensor(config.hash_method in ("random", "modulo"), device=device))
        self._fitted = bool(self.table_fitted)  # host copy: forwards never read the device
        self.register_load_state_dict_post_hook(_read_fitted_flag)

    @property
    def needs_fit(self) -> bool:
        """Whether the table still has to be fitted (``frequency`` or ``clustered`` before :meth:`fit_frequency` /
        :meth:`fit_clusters` or loading a fitted state)."""
        return not self._fitted

    def _set_table(self, table: Tensor) -> None:
        self.expert_of_token.copy_(table)
        self.table_fitted.fill_(True)
        self._fitted = True

    @torch.no_grad()
    def fit_frequency(self, token_counts: Tensor) -> None:
        """Balance the experts' token counts: ``token_counts [vocab_size]`` occurrences of each id in the corpus.
        Greedy longest-processing-time assignment (one pass over the vocabulary, at setup)."""
        if self.hash_method != "frequency":
            raise ValueError(f"fit_frequency is for hash_method='frequency'; this router's is {self.hash_method!r}")
        if token_counts.shape != (self.vocab_size,):
            raise ValueError(
                f"token_counts of shape {tuple(token_counts.shape)}; expected [vocab_size] = [{self.vocab_size}]"
            )
        counts = token_counts.detach().double().cpu()
        order = torch.sort(counts, descending=True, stable=True).indices.tolist()
        loads = [(0.0, e) for e in range(self.num_experts)]  # a heap of (total count, expert)
        table = torch.empty(self.vocab_size, dtype=torch.long)
        for token in order:
            load, expert = heapq.heappop(loads)
            table[token] = expert
            heapq.heappush(loads, (load + counts[token].item(), expert))
        self._set_table(table)

    @torch.no_grad()
    def fit_clusters(self, embeddings: Tensor, iterations: int = 50) -> None:
        """Cluster ``embeddings [vocab_size, d]`` into ``num_experts`` groups by k-means (k-means++ seeding with
        ``hash_seed``, Lloyd iterations) and send each id to its cluster's expert. Clusters are not balanced."""
        if self.hash_method != "clustered":
            raise ValueError(f"fit_clusters is for hash_method='clustered'; this router's is {self.hash_method!r}")
        if embeddings.dim() != 2 or embeddings.shape[0] != self.vocab_size:
            raise ValueError(
                f"embeddings of shape {tuple(embeddings.shape)}; expected [vocab_size = {self.vocab_size}, dim]"
            )
        self._set_table(kmeans(embeddings.detach().float().cpu(), self.num_experts, iterations, self.hash_seed))

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Routing:
        """``token_ids: [N]`` long -> :class:`Routing` with ``k = 1`` and gates 1 (``x`` is not read)."""
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
        if not self._fitted:
            raise ValueError(
                f"HashMoE with hash_method={self.hash_method!r} has no table yet: fit it first with "
                "moekit.models.fit_hash_routing(model, token_ids) (the training template does this when training "
                "starts), or load a fitted checkpoint"
            )
        expert_ids = self.expert_of_token.index_select(0, token_ids.reshape(-1)).unsqueeze(1)
        gates = torch.ones(expert_ids.shape, device=token_ids.device)
        return Routing(expert_ids, gates)


HASH_METHODS = ("random", "modulo", "frequency", "clustered")


def _read_fitted_flag(module: HashRouter, incompatible_keys) -> None:
    module._fitted = bool(module.table_fitted)


def kmeans(points: Tensor, k: int, iterations: int, seed: int) -> Tensor:
    """Cluster ids ``[n]`` of ``points [n, d]`` into ``k`` clusters: k-means++ seeding, then Lloyd iterations (an
    emptied cluster restarts at the point farthest from its centre)."""
    n = points.shape[0]
    if n < k:
        raise ValueError(f"k-means of {n} points into {k} clusters: need at least as many points as clusters")
    generator = torch.Generator().manual_seed(seed)
    centres = points[torch.randint(n, (1,), generator=generator)]
    for _ in range(1, k):
        distance = torch.cdist(points, centres).min(dim=1).values.pow(2)
        weights = distance if distance.sum() > 0 else torch.ones(n)
        centres = torch.cat([centres, points[torch.multinomial(weights, 1, generator=generator)]])
    for _ in range(iterations):
        distance = torch.cdist(points, centres)
        assignment = distance.argmin(dim=1)
        sums = torch.zeros_like(centres).index_add_(0, assignment, points)
        sizes = torch.bincount(assignment, minlength=k)
        for cluster in (sizes == 0).nonzero().flatten().tolist():
            far = distance.min(dim=1).values.argmax()
            sums[cluster], sizes[cluster] = points[far], 1
            distance[far] = 0.0
        updated = sums / sizes.unsqueeze(1)
        if torch.equal(updated, centres):
            break
        centres = updated
    return torch.cdist(points, centres).argmin(dim=1)


class BalancedRouter(Router):
    """BASE layer routing (Lewis et al. 2021).

    Affinities ``s = x W^T`` (one learned embedding per expert). In training, the assignment
    maximising the total affinity with every expert taking ``N / E`` tokens (±1 when ``E`` does not
    divide ``N``) is solved by :func:`balanced_assignment`; at inference each token takes its best
    expert. The gate is ``sigmoid(s[n, a(n)])``, the paper's residual weighting.
    """

    @dataclass(kw_only=True)
    class Config:
        num_experts: int = 8

        def __post_init__(self) -> None:
            _check_k(self.num_experts, 1)

    def __init__(self, in_features: int, config: Config, device=None, dtype=None) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = 1
        self.weight = router_weight(config.num_experts, in_features, device, dtype)

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Routing:
        scores = router_logits(x, self.weight)
        if self.training:
            caps = balanced_capacities(x.shape[0], self.num_experts, x.device)
            # Non-finite scores would keep the assignment's auction from ending: assign as if they were 0.
            # The gates below still carry them, so the loss is non-finite and NonFiniteGuard skips the step.
            finite = torch.nan_to_num(scores.detach(), nan=0.0, posinf=0.0, neginf=0.0)
            expert_ids = balanced_assignment(finite, caps).unsqueeze(1)
        else:
            expert_ids = scores.argmax(dim=-1, keepdim=True)
        gates = torch.sigmoid(scores.gather(1, expert_ids))
        return Routing(
            expert_ids, gates, torch.softmax(scores, dim=-1), priority=None, logit_checksum=logit_checksum(scores)
        )


def _balanced_divisor(n: int) -> int:
    """The largest divisor ``d`` of ``n`` with ``d * d <= n`` (16 -> 4, 8 -> 2, 256 -> 16)."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


class HierarchicalRouter(Router):
    """Two-level noisy top-k gating of Shazeer et al. 2017, appendix B.

    The ``num_experts`` experts come in ``num_groups`` equal groups (None: the largest divisor of
    ``num_experts`` not above its square root). A primary gate picks ``top_k_groups`` groups; inside each
    chosen group ``i`` a secondary gate picks ``top_k`` of its experts, so a token uses
    ``top_k_groups * top_k`` experts (:attr:`top_k`). Expert ``(i, j)`` has flat index
    ``i * experts_per_group + j`` and gate ``G_primary(x)_i * G_i(x)_j``. Both levels use noisy top-k gating
    with renormalised gates (Shazeer's ``softmax(KeepTopK(H))``).

    Losses (appendix B): ``importance`` is ``CV^2`` of ``Importance_H[i, j] = sum_x G_p(x)_i G_i(x)_j``,
    ``load`` is ``CV^2`` of ``Load_H[i, j] = Load_p(X)_i * Load_i(X^(i))_j / |X^(i)|``, ``X^(i)``
    being the tokens the primary gate sends to group ``i``. ``router_init="zeros"`` starts both gates at zero
    (appendix A).
    """

    @dataclass(kw_only=True)
    class Config:
        num_experts: int = 16
        num_groups: int | None = None
        top_k_groups: int = 1
        top_k: int = 2
        noisy_gating: bool = True
        router_init: Literal["default", "zeros"] = "default"
        importance_loss_weight: float = 0.0
        load_loss_weight: float = 0.0

        def __post_init__(self) -> None:
            _check_k(self.num_experts, 1)
            _check_init(self.router_init)
            if self.num_groups is None:
                self.num_groups = _balanced_divisor(self.num_experts)
            if (
                isinstance(self.num_groups, bool)
                or not isinstance(self.num_groups, int)
                or self.num_groups < 1
                or (self.num_experts % self.num_groups)
            ):
                raise ValueError(
                    f"num_groups={self.num_groups!r} must divide num_experts={self.num_experts} (the experts "
                    "come in equal groups); null picks a divisor"
                )
            _check_k(self.num_groups, self.top_k_groups, "top_k_groups")
            _check_k(self.num_experts // self.num_groups, self.top_k, "top_k (experts per chosen group)")
            _check_weights(importance_loss_weight=self.importance_loss_weight, load_loss_weight=self.load_loss_weight)
            if self.load_loss_weight and not self.noisy_gating:
                raise ValueError(f"load_loss_weight={self.load_loss_weight} needs noisy_gating=True")

    def __init__(self, in_features: int, config: Config, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.num_groups = config.num_groups
        self.experts_per_group = config.num_experts // config.num_groups
        self.top_k_groups = config.top_k_groups
        self.top_k_per_group = config.top_k
        self.top_k = config.top_k_groups * config.top_k
        dd = {"device": device, "dtype": dtype}
        self.primary_weight = router_weight(self.num_groups, in_features, **dd)
        self.secondary_weight = router_weight(self.num_experts, in_features, **dd)
        if config.noisy_gating:
            self.primary_noise = nn.Parameter(torch.zeros(self.num_groups, in_features, **dd))
            self.secondary_noise = nn.Parameter(torch.zeros(self.num_experts, in_features, **dd))
        else:
            self.primary_noise = self.secondary_noise = None
        if config.router_init == "zeros":
            nn.init.zeros_(self.primary_weight)
            nn.init.zeros_(self.secondary_weight)

    def _noisy(self, x: Tensor, weight: Tensor, noise_weight: Tensor | None):
        clean = router_logits(x, weight)
        if noise_weight is None or not self.training:
            return clean, clean, None
        noise_std = F.softplus(router_logits(x, noise_weight))
        return clean, clean + torch.randn_like(clean) * noise_std, noise_std

    @staticmethod
    def _keep_top_k_softmax(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        top = logits.topk(k, dim=-1)
        return top.indices, torch.softmax(top.values, dim=-1)

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Routing:
        num_tokens = x.shape[0]
        groups, per_group, k = self.num_groups, self.experts_per_group, self.top_k_per_group
        p_clean, p_noisy, p_std = self._noisy(x, self.primary_weight, self.primary_noise)
        group_ids, group_gates = self._keep_top_k_softmax(p_noisy, self.top_k_groups)  # [N, kg]
        s_clean, s_noisy, s_std = self._noisy(x, self.secondary_weight, self.secondary_noise)
        s_noisy = s_noisy.view(num_tokens, groups, per_group)
        local_ids, local_gates = self._keep_top_k_softmax(s_noisy, k)  # [N, G, k]
        # Keep the secondary choices of the chosen groups only.
        idx = group_ids.unsqueeze(-1).expand(-1, -1, k)
        chosen_local = local_ids.gather(1, idx)  # [N, kg, k]
        chosen_gates = local_gates.gather(1, idx) * group_gates.unsqueeze(-1)
        expert_ids = (group_ids.unsqueeze(-1) * per_group + chosen_local).reshape(num_tokens, -1)
        gates = chosen_gates.reshape(num_tokens, -1)
        order = gates.argsort(dim=-1, descending=True)  # best first, as other routers
        expert_ids, gates = expert_ids.gather(1, order), gates.gather(1, order)

        cfg = self.config
        losses: dict[str, Tensor] = {}
        if cfg.importance_loss_weight:
            dense = torch.zeros(num_tokens, self.num_experts, device=x.device).scatter(1, expert_ids, gates)
            losses["importance"] = cfg.importance_loss_weight * importance_loss(dense)
        if cfg.load_loss_weight and p_std is not None:
            load_primary = smooth_load(p_clean, p_noisy, p_std, self.top_k_groups)  # [G]
            in_group = torch.zeros(num_tokens, groups, device=x.device).scatter(1, group_ids, 1.0)  # X^(i) mask
            flat = (num_tokens * groups, per_group)  # every group's secondary gate as its own row
            per_token = load_probabilities(s_clean.reshape(flat), s_noisy.reshape(flat), s_std.reshape(flat), k).view(
                num_tokens, groups, per_group
            )
            load_secondary = (per_token * in_group.unsqueeze(-1)).sum(0)  # [G, per_group]
            group_size = in_group.sum(0).clamp_min(1.0)
            load_h = load_primary.unsqueeze(-1) * load_secondary / group_size.unsqueeze(-1)
            losses["load"] = cfg.load_loss_weight * cv_squared(load_h.reshape(-1))
        probs = torch.softmax(p_noisy, -1).repeat_interleave(per_group, dim=1) * torch.softmax(s_noisy, -1).reshape(
            num_tokens, -1
        )
        return Routing(
            expert_ids,
            gates,
            probs,
            priority=gates[:, 0],
            aux_losses=losses,
            logit_checksum=logit_checksum(p_noisy, s_noisy),
        )
