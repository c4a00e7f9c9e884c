"""An MoE layer from a recipe (:mod:`moekit.recipes`), sized for the MLP it replaces.

The models of :mod:`moekit.models` build their MoE layers here: the recipe gives the layer and its settings,
the model gives the timm ``Mlp`` keywords of the MLP being replaced and the facts only it knows (tokens per
sequence for Soft MoE's slots, the vocabulary for hash routing, gated feed-forwards), and the recipe's
``granularity`` divides the MLP's hidden size into the experts' (fine-grained experts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moekit.recipes import resolve_recipe

from .base import MoELayer, get_moe_layer

__all__ = ["build_moe_layer", "expert_hidden_features"]

_SPEC_KEYS = ("name", "layer", "granularity")


def expert_hidden_features(hidden_features: int, granularity: float = 1) -> int:
    """Each expert's hidden size: the replaced MLP's ``hidden_features / granularity``, rounded, at least 1."""
    if isinstance(granularity, bool) or not isinstance(granularity, (int, float)) or not granularity > 0:
        raise ValueError(f"granularity={granularity!r} must be a positive number (expert hidden = MLP hidden / it)")
    return max(1, round(hidden_features / granularity))


def build_moe_layer(
    moe: str | Mapping[str, Any],
    *,
    in_features: int,
    hidden_features: int,
    act_layer=None,
    bias: bool | tuple[bool, bool] = True,
    drop: float | tuple[float, float] = 0.0,
    model_settings: Mapping[str, Any] | None = None,
    device=None,
    dtype=None,
) -> MoELayer:
    """Build the layer of ``moe`` (a recipe name or spec, see :func:`moekit.recipes.resolve_recipe`) in place
    of an MLP ``in_features -> hidden_features -> in_features``.

    ``model_settings`` are settings the model supplies when the layer takes them and the recipe leaves them
    unset (``num_tokens``, ``vocab_size``, ``gated``). A recipe setting the layer does not take is a
    ``ValueError`` naming it and the layer's settings.
    """
    spec = resolve_recipe(moe)
    layer_cls = get_moe_layer(spec["layer"])
    settings = {key: value for key, value in spec.items() if key not in _SPEC_KEYS}
    accepted = layer_cls.settings()
    for key, value in (model_settings or {}).items():
        if key in accepted:
            settings.setdefault(key, value)
    label = f"MoE recipe {spec['name']!r}" if spec.get("name") else f"MoE layer {spec['layer']!r}"
    unknown = sorted(settings.keys() - set(accepted))
    if unknown:
        raise ValueError(
            f"{label} sets {unknown}, which {layer_cls.__name__} does not take; its settings: {', '.join(accepted)}"
        )
    kwargs = {} if act_layer is None else {"act_layer": act_layer}
    try:
        return layer_cls(
            in_features,
            expert_hidden_features(hidden_features, spec.get("granularity", 1)),
            bias=bias,
            drop=drop,
            device=device,
            dtype=dtype,
            **kwargs,
            **settings,
        )
    except ValueError as err:
        raise ValueError(f"{label}: {err}") from None
