"""MoE recipes: the routing schemes of the literature with their papers' settings, one YAML file each.

A recipe (``moe/<name>.yaml`` in this package) is a mapping: ``name``; ``layer``, the registry name of an MoE
layer of :mod:`moekit.moe`; that layer's settings (``num_experts``, ``top_k``, ``capacity_factor``, loss
weights, ...); and optionally ``granularity``: each expert's hidden size is the hidden size of the MLP it
replaces divided by it (fine-grained experts, DeepSeekMoE; 1 by default). Sizes that depend on the model
(the MLP's hidden size, Soft MoE's tokens per sequence, hash routing's vocabulary) are filled in by the model
the recipe lands in. The first comment line of each file cites the paper's settings.

The files are the one source of the recipes: the training template's config group ``moe=<name>`` is this folder (the
``hydra_plugins/moekit_recipes`` plugin adds ``pkg://moekit.recipes`` to Hydra's search path), and the models of
:mod:`moekit.models` take ``moe="<name>"``. ``moe/none.yaml`` is the template's "no MoE" choice.

This module imports no torch, so that the template refuses a recipe its model cannot use (:func:`check_fits`)
before torch loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml

__all__ = [
    "list_recipes",
    "load_recipe",
    "recipe_citation",
    "resolve_recipe",
    "needs_token_ids",
    "mixes_tokens",
    "routes_by_position",
    "check_fits",
    "check_expert_parallel",
]

_FOLDER = resources.files(__name__) / "moe"
_NO_MOE = "none"

# Layers whose routing of a token looks at other tokens of the forward, whatever their settings.
_TOKEN_MIXING_LAYERS = frozenset({"soft_moe", "experts_choice", "base"})
# Tokens-choice layers: with a capacity over the whole batch a token's drop depends on the other tokens.
_CAPACITY_LAYERS = frozenset({"top_k", "hierarchical"})
# Layers that balance over the batch in training unless ``balance_scope: position``.
_BALANCE_SCOPE_LAYERS = frozenset({"strictly_balanced"})
# Layers that route by token id (a model must pass ``token_ids``).
_TOKEN_ID_LAYERS = frozenset({"hash"})
# Layers that route by position in the sequence (a model must pass positions and a decoding state).
_POSITION_LAYERS = frozenset({"lory"})
# Layers that merge all their experts into one for every token (the layers' ``merges_experts``).
_MERGING_LAYERS = frozenset({"lory"})


def list_recipes() -> list[str]:
    """The names of the recipes (``none`` excluded)."""
    names = (entry.name.removesuffix(".yaml") for entry in _FOLDER.iterdir() if entry.name.endswith(".yaml"))
    return sorted(name for name in names if name != _NO_MOE)


def load_recipe(name: str) -> dict[str, Any]:
    """The recipe ``name`` as a dict (see the module docstring for its keys)."""
    if name not in list_recipes():
        raise ValueError(f"unknown MoE recipe {name!r}; recipes: {', '.join(list_recipes())} (or none for no MoE)")
    return yaml.safe_load((_FOLDER / f"{name}.yaml").read_text())


def recipe_citation(name: str) -> str:
    """The first comment line of recipe ``name``: the paper, its settings, and the expert compute per token
    relative to the dense MLP the layer replaces ("expert compute 2x the dense MLP's")."""
    load_recipe(name)  # an unknown name is an error naming the recipes
    first = (_FOLDER / f"{name}.yaml").read_text().splitlines()[0]
    return first.removeprefix("#").strip()


def resolve_recipe(moe: str | Mapping[str, Any] | None, **overrides: Any) -> dict[str, Any] | None:
    """An MoE spec from what a model is given: None or ``"none"`` (no MoE), a recipe name, or a mapping (a
    recipe already loaded, e.g. the template's ``moe`` config, or ``{"recipe": name, **changes}``);
    ``overrides`` change single settings (``num_experts=16``). Returns a new dict with a ``layer`` key.

    The ``none`` recipe as a mapping (``{"name": "none", ...}``: the template's ``moe=none`` with the settings
    an experiment gave its own recipe merged in) is no MoE too: those settings have nothing to apply to."""
    if isinstance(moe, Mapping) and moe.get("name") == _NO_MOE and "layer" not in moe and "recipe" not in moe:
        moe = None
    if moe is None or moe == _NO_MOE:
        if overrides:
            raise ValueError(f"MoE settings {sorted(overrides)} given without an MoE recipe (moe=None)")
        return None
    if isinstance(moe, str):
        spec = load_recipe(moe)
    elif isinstance(moe, Mapping):
        spec = dict(moe)
        base = spec.pop("recipe", None)
        if base is not None:
            spec = {**load_recipe(base), **spec}
    else:
        raise ValueError(f"moe={moe!r}: give a recipe name ({', '.join(list_recipes())}), a mapping, or None")
    spec.update(overrides)
    if not isinstance(spec.get("layer"), str):
        raise ValueError(
            f"MoE spec {spec!r} names no layer; give a recipe name or a mapping with 'layer' (an MoE layer's "
            "registry name) or 'recipe' (a recipe to start from)"
        )
    return spec


def _label(spec: Mapping[str, Any]) -> str:
    name = spec.get("name")
    return f"recipe {name!r}" if name else f"MoE layer {spec['layer']!r}"


def needs_token_ids(spec: Mapping[str, Any]) -> bool:
    """Whether the recipe routes by token id (hash routing): only models with token ids can use it."""
    return spec["layer"] in _TOKEN_ID_LAYERS


def routes_by_position(spec: Mapping[str, Any]) -> bool:
    """Whether the recipe's layer reads the tokens' positions, and a decoding state, in a language model: Lory's
    segments and capacity per group of a sequence's tokens (``capacity_scope: group``)."""
    layer = spec["layer"]
    return layer in _POSITION_LAYERS or (layer in _CAPACITY_LAYERS and spec.get("capacity_scope") == "group")


def mixes_tokens(spec: Mapping[str, Any]) -> bool:
    """Whether the recipe's routing of a token depends on other tokens of the forward (then a causal language
    model would let a token see the future): Soft MoE, experts-choice, BASE, tokens-choice capacity over the whole
    batch (``capacity_scope: position`` keeps it per token; ``group`` serves a sequence's tokens in order) and
    strictly balanced gating over the whole batch (``balance_scope: position`` keeps it per position)."""
    layer = spec["layer"]
    if layer in _TOKEN_MIXING_LAYERS:
        return True
    if layer in _BALANCE_SCOPE_LAYERS:
        return spec.get("balance_scope", "batch") != "position"
    if layer not in _CAPACITY_LAYERS:
        return False
    has_capacity = spec.get("capacity_factor") is not None or spec.get("eval_capacity_factor") not in (None, "same")
    scope = spec.get("capacity_scope", "batch")
    if scope == "group":  # consecutive tokens served in order: causal unless priority reorders them
        return has_capacity and spec.get("batch_priority", False)
    return has_capacity and scope != "position"


def check_fits(spec: Mapping[str, Any], *, model: str, causal: bool, token_ids: bool, positions: bool = False) -> None:
    """Refuse a recipe its model cannot serve, with the reason and the alternative.

    Args:
        spec: the MoE spec (:func:`resolve_recipe`).
        model: the model, for the message (``"a ViT"``, ``"the Transformer LM"``).
        causal: the model is a causal (decoder) language model.
        token_ids: the model passes token ids to its MoE layers.
        positions: the model passes token positions and a decoding state to its MoE layers.
    """
    what = _label(spec)
    if spec["layer"] in _POSITION_LAYERS and not positions:
        raise ValueError(
            f"{what} routes each segment of a sequence by the previous segment, which needs the tokens' positions "
            f"and a decoding state; {model} does not pass them (the Transformer LM does). Use another recipe, e.g. "
            "moe=mixtral or moe=dense_moe"
        )
    if needs_token_ids(spec) and not token_ids:
        raise ValueError(
            f"{what} routes each token by its token id, and {model} has no token ids (its tokens are "
            "patches or features). Use a recipe that routes on the token itself, e.g. moe=switch, moe=top2 or "
            "moe=soft_moe; hash routing serves the language models"
        )
    if causal and mixes_tokens(spec):
        if spec["layer"] in _BALANCE_SCOPE_LAYERS:
            fix = f"set {_override(spec, 'balance_scope', 'position')} (each expert takes its share of each position)"
        elif spec["layer"] in _CAPACITY_LAYERS:
            fix = (
                f"set {_override(spec, 'capacity_scope', 'position')} (tokens compete per position) or make it "
                f"dropless ({_override(spec, 'capacity_factor', 'null')} "
                f"{_override(spec, 'eval_capacity_factor', 'null')})"
            )
        else:
            fix = "use a per-token router: moe=mixtral, moe=deepseek, moe=noisy_top_k, moe=hash or moe=dense_moe"
        raise ValueError(
            f"{what} ({spec['layer']}) routes a token by looking at the other tokens of the batch, later ones "
            f"included, so {model} (causal) would see the future; {fix}"
        )
    if causal and routes_by_position(spec) and not positions:
        raise ValueError(
            f"{what} counts capacity per group of a sequence's tokens (capacity_scope=group), which a cached decode "
            f"must carry from token to token; {model} does not (the Transformer LM does). Set "
            f"{_override(spec, 'capacity_scope', 'position')}"
        )


def _override(spec: Mapping[str, Any], key: str, value: str) -> str:
    """The override that sets ``moe.<key>``: with a leading ``+`` where the recipe's file does not list the key."""
    return f"{'' if key in spec else '+'}moe.{key}={value}"


def check_expert_parallel(spec: Mapping[str, Any], size: int) -> None:
    """Refuse expert parallelism over ``size`` > 1 ranks for a recipe whose layer merges all of its experts into
    one for every token (Lory): no rank could compute a token without every expert."""
    if isinstance(size, int) and size > 1 and spec["layer"] in _MERGING_LAYERS:
        raise ValueError(
            f"{_label(spec)} merges all of a layer's experts into one for every token, so "
            f"trainer.strategy.expert_parallel_size={size} cannot split them over ranks; set "
            "trainer.strategy.expert_parallel_size=1 (data parallel), or use another recipe, e.g. moe=mixtral"
        )
