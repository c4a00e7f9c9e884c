"""What a network computes beyond the shapes of its weights: the settings that two networks must share for the weights
of one to compute the same function in the other.

Loading weights checks every name and shape. A ViT with 2 attention heads of 64 and one with 4 heads of 32 have
weights of the same shapes and compute different functions; so do two networks whose norms' epsilons, activations,
rotary bases or poolings differ. :func:`setting_differences` compares the modules two networks have at the same place:
their classes and :data:`ARCHITECTURE_FIELDS`. Modules that only regularise training (dropout, stochastic depth, patch
dropout: the identity in evaluation) may differ. Upcycling (:mod:`moekit.models.upcycle`) compares an MoE network
with its dense twin; fine-tuning compares a network with the one its checkpoint trained
(:func:`checkpoint_differences`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from timm.layers import DropPath, PatchDropout
from torch import nn

from moekit.moe import MixtureOfDepths, moe_layers, routing_modules

__all__ = [
    "ARCHITECTURE_FIELDS",
    "checkpoint_differences",
    "expert_activations",
    "outside_routing",
    "setting_differences",
]

ARCHITECTURE_FIELDS = (
    "num_heads", "num_kv_heads", "head_dim", "scale",  # attention: timm's and moekit's
    "eps", "approximate", "negative_slope",  # norms and activations
    "base",  # rotary position embeddings
    "global_pool", "num_prefix_tokens", "no_embed_class", "has_class_token", "pool_include_prefix",  # timm's ViT
    "gate_last",  # which half of a timm GluMlp's fc1 is the gate
)  # fmt: skip
"""Settings that change what a module computes without changing the shape of a weight."""

POOLING_FIELDS = ("global_pool", "pool_include_prefix")
"""A classifier's pooling, which fine-tuning may change with its head."""

_ACTIVATION_FIELDS = ("approximate", "negative_slope")
_TRAINING_ONLY = (nn.Identity, nn.modules.dropout._DropoutNd, DropPath, PatchDropout)  # the identity in evaluation

Pair = tuple[str, nn.Module, nn.Module, tuple[str, ...]]  # name, our module, theirs, the fields to compare


def setting_differences(pairs: Iterable[Pair], ours: str, theirs: str) -> list[str]:
    """For each ``(name, our module, their module, fields)``: another class (training-only modules aside) or another
    value of one of ``fields``. One line per difference, ``"<field>: <theirs> X vs <ours> Y (<module names>)"``."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for name, mine, other, fields in pairs:
        if isinstance(mine, _TRAINING_ONLY) and isinstance(other, _TRAINING_ONLY):
            continue
        if type(mine) is not type(other):
            found.setdefault(("class", *_class_names(other, mine)), []).append(name or "the model")
            continue
        for field in fields:
            value, other_value = getattr(mine, field, None), getattr(other, field, None)
            if value != other_value:
                found.setdefault((field, repr(other_value), repr(value)), []).append(name or "the model")
    return [f"{what}: {theirs} {b} vs {ours} {a} ({', '.join(names)})" for (what, b, a), names in found.items()]


def _class_names(*modules: nn.Module) -> tuple[str, ...]:
    """The modules' class names, qualified by their modules where they read the same (timm's ``LayerNorm`` and
    torch's)."""
    names = tuple(type(m).__name__ for m in modules)
    return tuple(f"{type(m).__module__}.{type(m).__qualname__}" for m in modules) if len(set(names)) == 1 else names


def outside_routing(model: nn.Module, other: nn.Module, other_name: Callable[[str], str], fields) -> Iterable[Pair]:
    """``model``'s modules outside its MoE layers and Mixture-of-Depths routing (the wrappers' own settings are
    routing settings; the blocks they wrap are compared), each with the module of ``other`` named ``other_name(name)``
    (those ``other`` lacks are the key check's to report)."""
    routed = tuple(f"{name}." for name, _ in routing_modules(model))
    for name, module in model.named_modules():
        if f"{name}.".startswith(routed) or isinstance(module, MixtureOfDepths):
            continue
        try:
            yield name, module, other.get_submodule(other_name(name)), fields
        except AttributeError:
            continue


def expert_activations(model: nn.Module, other: nn.Module, other_name: Callable[[str], str]) -> Iterable[Pair]:
    """The experts' activation of each of ``model``'s MoE layers, with the module of ``other`` named
    ``other_name(<layer name>)``."""
    for name, layer in moe_layers(model):
        try:
            yield f"{name}.experts.act", layer.experts.act, other.get_submodule(other_name(name)), _ACTIVATION_FIELDS
        except AttributeError:
            continue


def checkpoint_differences(model: nn.Module, trained: nn.Module) -> list[str]:
    """Where ``trained`` (the network a checkpoint was trained as) computes otherwise than ``model`` beyond its
    weights, pooling aside: outside the MoE layers and Mixture-of-Depths routers, as :func:`setting_differences`
    finds; in each MoE layer, the experts' activation. Router settings (top-k, capacity, ...) may change."""
    fields = tuple(f for f in ARCHITECTURE_FIELDS if f not in POOLING_FIELDS)
    pairs = [
        *outside_routing(model, trained, lambda name: name, fields),
        *expert_activations(model, trained, lambda name: f"{name}.experts.act"),
    ]
    return setting_differences(pairs, ours="model", theirs="checkpoint")
