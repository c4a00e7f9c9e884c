"""Where MoE layers go in a stack of blocks, and the keywords they are built with: shared by the MoE
ViTs (:mod:`moekit.models.vit`) and the language models (:mod:`moekit.models.lm`).

Placement (``moe_blocks``), for a model of ``depth`` blocks numbered ``0 .. depth - 1``:

* ``"second_half"``: blocks ``depth // 2 .. depth - 1`` (Soft MoE paper);
* ``"all"``: every block;
* ``"every_<k>"``: every k-th block, counted back from the last one, so the last block is MoE
  (V-MoE's "Every-k"; ``"every_2"`` of 12 blocks is 1, 3, ..., 11);
* ``"last_<n>"``: the last ``n`` blocks;
* ``"every_<k>_last_<n>"``: the last ``n`` blocks of ``"every_<k>"`` (V-MoE's "Last-n" is
  ``"every_2_last_<n>"``: ``"every_2_last_5"`` of 12 blocks is 3, 5, 7, 9, 11);
* a sequence of block indices (negative ones count from the end).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MoEBlocks", "EXPERT_INIT_STD", "MLP_KEYWORDS", "resolve_moe_blocks", "moe_layer_kwargs"]

MoEBlocks = str | Sequence[int]

EXPERT_INIT_STD = 0.02
"""Std of the truncated normal for expert weights: timm's ViT initialisation of its ``nn.Linear`` layers."""

MLP_KEYWORDS = frozenset(
    (
        "in_features",
        "hidden_features",
        "out_features",
        "act_layer",
        "norm_layer",
        "bias",
        "drop",
        "use_conv",
        "device",
        "dtype",
    )
)
"""The timm ``Mlp`` keywords: a model builder derives them from its own settings."""

_PLACEMENT_FORMS = (
    "'second_half', 'all', 'every_<k>', 'last_<n>', 'every_<k>_last_<n>' (k, n >= 1) or a sequence of block indices"
)
_PLACEMENT_RE = re.compile(r"^(?:every_(?P<every>[1-9]\d*)(?:_last_(?P<last>[1-9]\d*))?|last_(?P<last_only>[1-9]\d*))$")


def _every_k(depth: int, k: int) -> list[int]:
    return [i for i in range(depth) if (depth - 1 - i) % k == 0]


def resolve_moe_blocks(moe_blocks: MoEBlocks, depth: int, *, model_name: str = "ViT") -> tuple[int, ...]:
    """Turn a placement (see the module docstring) into sorted block indices in ``[0, depth)``.

    ``model_name`` names the model in error messages ("a ViT of depth=6 has only ...").

    Raises ``ValueError`` for an unknown placement string, an index out of range, a duplicate index,
    more MoE blocks than blocks, or a placement that selects no block.
    """
    if isinstance(moe_blocks, str):
        match = _PLACEMENT_RE.match(moe_blocks)
        if moe_blocks == "second_half":
            indices = list(range(depth // 2, depth))
        elif moe_blocks == "all":
            indices = list(range(depth))
        elif match:
            candidates = _every_k(depth, int(match["every"] or 1))
            last = int(match["last"] or match["last_only"] or len(candidates))
            if last > len(candidates):
                raise ValueError(
                    f"moe_blocks={moe_blocks!r} asks for {last} MoE blocks but a {model_name} of depth={depth} has "
                    f"only {len(candidates)} such blocks"
                )
            indices = candidates[len(candidates) - last :]
        else:
            raise ValueError(f"moe_blocks={moe_blocks!r} is not a placement; use {_PLACEMENT_FORMS}")
    else:
        if not isinstance(moe_blocks, Sequence) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in moe_blocks
        ):
            raise ValueError(f"moe_blocks={moe_blocks!r} is not a placement; use {_PLACEMENT_FORMS}")
        if len(moe_blocks) > depth:
            raise ValueError(f"moe_blocks={list(moe_blocks)} names {len(moe_blocks)} MoE blocks but depth={depth}")
        for i in moe_blocks:
            if not -depth <= i < depth:
                raise ValueError(
                    f"moe_blocks index {i} is out of range for depth={depth} (allowed: {-depth} .. {depth - 1})"
                )
        indices = [i % depth for i in moe_blocks]
        if len(set(indices)) != len(indices):
            raise ValueError(f"moe_blocks={list(moe_blocks)} names a block twice (indices {indices} modulo depth)")
    if not indices:
        raise ValueError(
            f"moe_blocks={moe_blocks!r} selects no block; an MoE {model_name} needs at least one MoE block"
        )
    return tuple(sorted(indices))


_VIT_SOURCES = "embed_dim, mlp_ratio, act_layer, proj_bias, proj_drop_rate, device, dtype"


def moe_layer_kwargs(
    layer_cls: type,
    moe_layer: str,
    num_experts: int | None,
    moe_kwargs: Mapping[str, Any] | None,
    *,
    model_name: str = "ViT",
    derived_keywords: frozenset[str] = MLP_KEYWORDS,
    derived_from: str = _VIT_SOURCES,
    expert_init_std: float | None = EXPERT_INIT_STD,
) -> dict[str, Any]:
    """The MoE keywords for ``layer_cls``: ``moe_kwargs`` checked against its signature, plus
    ``num_experts`` and the default ``expert_init_std``.

    Args:
        layer_cls: the MoE layer class (``get_moe_layer(moe_layer)``).
        moe_layer: its registry name, for error messages.
        num_experts: experts per layer; None keeps the layer's default (and is required for layers
            without a ``num_experts`` keyword, such as ``"hierarchical"``).
        moe_kwargs: the user's further layer keywords.
        model_name: the model in error messages.
        derived_keywords: keywords the model sets itself (``moe_kwargs`` may not set them).
        derived_from: the model keywords they come from, for the error message.
        expert_init_std: default of the layer's ``expert_init_std`` (when it has one).
    """
    accepted = inspect.signature(layer_cls).parameters
    kwargs = dict(moe_kwargs or {})
    derived = sorted(derived_keywords & kwargs.keys())
    if derived:
        raise ValueError(
            f"moe_kwargs sets {derived}, which the builder takes from the {model_name} ({derived_from}); "
            f"set those as {model_name} keywords"
        )
    if "num_experts" in kwargs:
        raise ValueError("moe_kwargs sets num_experts; pass it as the num_experts argument instead")
    unknown = sorted(kwargs.keys() - accepted.keys())
    if unknown:
        allowed = sorted(accepted.keys() - derived_keywords - {"num_experts"})
        raise ValueError(
            f"moe_kwargs keys {unknown} are not keywords of {layer_cls.__name__} (moe_layer={moe_layer!r}); "
            f"allowed: {allowed}"
        )
    if num_experts is not None:
        if "num_experts" not in accepted:
            raise ValueError(
                f"moe_layer={moe_layer!r} ({layer_cls.__name__}) has no num_experts keyword; pass num_experts=None "
                "and size it through moe_kwargs"
            )
        kwargs["num_experts"] = num_experts
    if "expert_init_std" in accepted:
        kwargs.setdefault("expert_init_std", expert_init_std)
    return kwargs
