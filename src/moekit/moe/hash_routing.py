"""Hash routing (Roller et al. 2021, "Hash layers for large sparse models"): a fixed map token id -> expert, and
the ways to build the map (random, modulo, balanced by token frequency, clustered embeddings)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .routing import Router, Routing, check_top_k

__all__ = ["HashRouter", "HASH_METHODS", "kmeans"]


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
            check_top_k(self.num_experts, 1)
            if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
                raise ValueError(
                    f"vocab_size={self.vocab_size!r} must be a positive int (the token vocabulary; "
                    "the language models set it)"
                )
            if self.hash_method not in HASH_METHODS:
                raise ValueError(f"hash_method={self.hash_method!r}; allowed: {', '.join(map(repr, HASH_METHODS))}")
            if isinstance(self.hash_seed, bool) or not isinstance(self.hash_seed, int):
                raise ValueError(f"hash_seed={self.hash_seed!r} must be an int (the seed of the random table)")

    def __init__(self, in_features: int, config: Config, device=None, dtype=None) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = 1
        self.vocab_size = config.vocab_size
        self.hash_method = config.hash_method
        self.hash_seed = config.hash_seed
        self.register_buffer("expert_of_token", self._initial_table().to(device))
        fitted = config.hash_method in ("random", "modulo")
        self.register_buffer("table_fitted", torch.tensor(fitted, device=device))
        self._fitted = fitted  # host copy: forwards never read the device
        self.register_load_state_dict_post_hook(_read_fitted_flag)

    def _initial_table(self) -> Tensor:
        """``[vocab_size]``: the modulo table, or the random one (also where the fitted methods start)."""
        ids = torch.arange(self.vocab_size)
        if self.hash_method == "modulo":
            return ids % self.num_experts
        generator = torch.Generator().manual_seed(self.hash_seed)
        table = torch.empty(self.vocab_size, dtype=torch.long)
        table[torch.randperm(self.vocab_size, generator=generator)] = ids % self.num_experts
        return table

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The construction's table, unfitted for the fitted methods (for a router built on the meta device)."""
        self.expert_of_token.copy_(self._initial_table())
        self._fitted = self.hash_method in ("random", "modulo")
        self.table_fitted.fill_(self._fitted)

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
        Greedy longest-processing-time assignment (one pass over the vocabulary, at setup). The ids the corpus never
        shows add nothing to a count: each goes to the expert with the fewest ids, so that they spread evenly."""
        if self.hash_method != "frequency":
            raise ValueError(f"fit_frequency is for hash_method='frequency'; this router's is {self.hash_method!r}")
        if token_counts.shape != (self.vocab_size,):
            raise ValueError(
                f"token_counts of shape {tuple(token_counts.shape)}; expected [vocab_size] = [{self.vocab_size}]"
            )
        counts = token_counts.detach().double().cpu()
        order = torch.sort(counts, descending=True, stable=True).indices.tolist()
        loads = [(0.0, 0, e) for e in range(self.num_experts)]  # a heap of (total count, ids, expert)
        table = torch.empty(self.vocab_size, dtype=torch.long)
        seen = int((counts > 0).sum())
        for token in order[:seen]:
            load, ids, expert = heapq.heappop(loads)
            table[token] = expert
            heapq.heappush(loads, (load + counts[token].item(), ids + 1, expert))
        sizes = [(ids, load, expert) for load, ids, expert in loads]  # the unseen ids: a heap of (ids, count, expert)
        heapq.heapify(sizes)
        for token in order[seen:]:
            ids, load, expert = heapq.heappop(sizes)
            table[token] = expert
            heapq.heappush(sizes, (ids + 1, load, expert))
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

    def forward(self, x: Tensor, token_ids: Tensor | None = None, mask: Tensor | None = None) -> Routing:
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
        ids_N = token_ids.reshape(-1)
        if mask is not None:  # padding may hold any id (a -100): it is routed to expert 0 and dropped by the mask
            ids_N = torch.where(mask, ids_N, 0)
        try:
            expert_ids = self.expert_of_token.index_select(0, ids_N).unsqueeze(1)
        except IndexError:  # on CPUs; a GPU's index check is a device-side assert
            raise ValueError(
                f"HashMoE: token ids {int(ids_N.min())} .. {int(ids_N.max())} given, outside its vocabulary 0 .. "
                f"{self.vocab_size - 1}; build the layer with the tokenizer's vocab_size and pass the input ids"
            ) from None
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
