"""The settings of Mixture-of-Depths (Raposo et al. 2024), checked without torch: the models of
:mod:`moekit.models` take ``mod=`` as a mapping of these fields (or None), and the training template's
``mod=`` config group (``configs/mod/``) fills the model's ``mod`` entry. The layer is
:mod:`moekit.moe.depth`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DepthSpec", "resolve_depth"]

_GATES = ("logit", "sigmoid")
_CAUSAL_ROUTERS = ("aux_loss", "predictor")
_PLACEMENTS = "a placement ('every_2', 'all', 'last_<n>', 'every_<k>_last_<n>', ...) or a list of block indices"


@dataclass(frozen=True)
class DepthSpec:
    """How a model routes around its blocks.

    Attributes:
        capacity: the fraction of each sequence's tokens a routed block processes: the top
            ``ceil(capacity * tokens)`` router scores; in ``(0, 1]`` (the paper's best: 0.125).
        blocks: which blocks are routed, a placement of :func:`~moekit.models.placement.resolve_moe_blocks`
            (``"every_2"``: every other block, the last one included, as in the paper; ``"all"``; indices).
        gate: what multiplies a processed token's block output: ``"logit"``, the router logit itself
            (the paper's ``r_i f_i(X~)``), or ``"sigmoid"`` of it (a weight in (0, 1)).
        causal_router: how a causal model decides at inference, where the top-C of a sequence would look at
            later tokens: ``"aux_loss"`` trains the router logits with a binary cross-entropy against the
            top-C choice and processes a token when its logit is positive; ``"predictor"`` trains a small MLP
            on the router's input (gradient stopped) with that cross-entropy and decides with it.
        aux_loss_weight: the weight of that cross-entropy in the training loss (> 0 for a causal model).
        predictor_hidden: hidden size of the predictor MLP (``causal_router="predictor"`` only); None = ``dim // 4``.
    """

    capacity: float = 0.125
    blocks: str | Sequence[int] = "every_2"
    gate: str = "logit"
    causal_router: str = "aux_loss"
    aux_loss_weight: float = 0.01
    predictor_hidden: int | None = None

    def __post_init__(self) -> None:
        capacity = self.capacity
        if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not 0.0 < capacity <= 1.0:
            raise ValueError(
                f"mod: capacity={capacity!r} must be a fraction in (0, 1] of each sequence's tokens that a routed "
                "block processes, e.g. 0.125 (the paper's 12.5%); 1 processes every token"
            )
        blocks = self.blocks
        if not isinstance(blocks, str) and not (
            isinstance(blocks, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in blocks)
        ):
            raise ValueError(f"mod: blocks={blocks!r} must be {_PLACEMENTS}")
        if self.gate not in _GATES:
            raise ValueError(f"mod: gate={self.gate!r}; allowed: {', '.join(map(repr, _GATES))}")
        if self.causal_router not in _CAUSAL_ROUTERS:
            raise ValueError(
                f"mod: causal_router={self.causal_router!r}; allowed: {', '.join(map(repr, _CAUSAL_ROUTERS))}"
            )
        weight = self.aux_loss_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ValueError(f"mod: aux_loss_weight={weight!r} must be a finite number >= 0, e.g. 0.01")
        hidden = self.predictor_hidden
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
            raise ValueError(f"mod: predictor_hidden={hidden!r} must be a positive int, or None for dim // 4")
        if hidden is not None and self.causal_router != "predictor":
            raise ValueError(
                f"mod: predictor_hidden={hidden} sizes the predictor of causal_router='predictor' and would not "
                f"apply with causal_router={self.causal_router!r}; set causal_router=predictor or predictor_hidden "
                "to null"
            )

    def check_causal(self, model: str) -> None:
        """Refuse settings a causal model cannot decide with at inference."""
        if self.aux_loss_weight == 0:
            raise ValueError(
                f"{model}: mod.aux_loss_weight=0 leaves the causal router untrained, so sampling would decide "
                "at random which tokens a block processes; set it > 0 (e.g. 0.01)"
            )


def resolve_depth(mod: DepthSpec | Mapping[str, Any] | None) -> DepthSpec | None:
    """``mod`` as a :class:`DepthSpec`. None, ``{}`` and ``{"name": "none"}`` (the template's ``mod=none``) mean
    no Mixture-of-Depths; another ``name`` is a label (the template's config file) and dropped, so that a named
    config without settings is the defaults. An unknown key is a ``ValueError`` listing the allowed ones."""
    if mod is None or isinstance(mod, DepthSpec):
        return mod
    if not isinstance(mod, Mapping):
        raise ValueError(f"mod={mod!r} must be a mapping of Mixture-of-Depths settings or None")
    name = mod.get("name")
    mod = {key: value for key, value in mod.items() if key != "name"}
    if name == "none":
        if mod:
            raise ValueError(
                f"mod=none with settings {mod}: they would not apply; choose a Mixture-of-Depths config "
                "(mod=interleaved) or drop them"
            )
        return None
    if not mod and name is None:
        return None
    allowed = [f.name for f in dataclasses.fields(DepthSpec)]
    unknown = sorted(set(mod) - set(allowed))
    if unknown:
        raise ValueError(f"mod: unknown setting(s) {unknown}; allowed: {allowed}")
    blocks = mod.get("blocks", DepthSpec.blocks)
    if isinstance(blocks, Iterable) and not isinstance(blocks, (str, Mapping)):
        blocks = tuple(blocks)
    return DepthSpec(**{**mod, "blocks": blocks})
