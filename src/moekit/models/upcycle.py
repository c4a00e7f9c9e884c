"""Sparse upcycling (Komatsuzaki et al. 2023): start an MoE model from its trained dense twin.

Every weight outside the MoE layers is copied from the dense model; every expert of an MoE layer
becomes a copy of the dense MLP that sat at the same place (``blocks.i.mlp.fc1`` / ``fc2``, or timm's
``SwiGLU`` / ``GluMlp`` for gated experts); routers, Soft MoE's slot parameters and always-on shared
experts keep their fresh initialisation, and so do Mixture-of-Depths routers (a ViT block that Mixture-of-Depths
wraps, ``blocks.i.block``, reads the dense ``blocks.i``). :func:`upcycle` serves any model whose MoE layers replace
dense MLPs at the same names (the Transformer LM and its dense twin); :func:`upcycle_vit` also reads timm ViT
checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from timm.layers import GluMlp
from timm.models.vision_transformer import checkpoint_filter_fn
from torch import Tensor, nn

from moekit.moe import ExpertBank, MixtureOfDepths, depth_routers, moe_layers

from .architecture import ARCHITECTURE_FIELDS, expert_activations, outside_routing, setting_differences
from .export import with_tied_names

__all__ = ["architecture_differences", "upcycle", "upcycle_vit"]

log = logging.getLogger("moekit")


def _dense_mlp(entries: Mapping[str, Tensor], prefix: str, offending: list[str]) -> nn.Module:
    """A module with one ``nn.Linear`` per ``<child>.weight`` entry (``fc1``, ``fc2``, ``fc1_g``, ...): the
    attributes ``load_dense_mlp`` reads. Entries that are not a linear layer's weight or bias are added
    to ``offending``."""
    mlp = nn.Module()
    for key, weight in entries.items():
        child, _, kind = key.rpartition(".")
        if kind == "bias" and f"{child}.weight" in entries and weight.dim() == 1:
            continue
        if kind != "weight" or weight.dim() != 2 or not child or "." in child:
            offending.append(f"{prefix}{key} (not a linear layer of a dense MLP)")
            continue
        bias = entries.get(f"{child}.bias")
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
        mlp.add_module(child, linear)
    return mlp


def _into_depth_blocks(model: nn.Module, source: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """``source`` named as in ``model``: a dense block's ``blocks.i.*`` becomes ``blocks.i.block.*`` where a
    :class:`~moekit.moe.MixtureOfDepths` wraps block ``i``, and every Mixture-of-Depths router the weights lack keeps
    ``model``'s fresh values. Also returns the names of those routers."""
    wrapped = [f"{name}." for name, module in model.named_modules() if isinstance(module, MixtureOfDepths)]

    def renamed(key: str) -> str:
        prefix = next((p for p in wrapped if key.startswith(p)), None)
        if prefix is None or key.startswith((f"{prefix}block.", f"{prefix}depth_router.")):
            return key
        return f"{prefix}block.{key[len(prefix) :]}"

    source = {renamed(key): value for key, value in source.items()}
    own = model.state_dict()
    fresh = []
    for name, _ in depth_routers(model):
        keys = [k for k in own if k.startswith(f"{name}.")]
        if not any(k in source for k in keys):
            fresh.append(name)
            source |= {k: own[k] for k in keys}
    return source, fresh


def _dense_names(moe_model: nn.Module):
    """The dense model's name of each module of ``moe_model``: the block a Mixture-of-Depths wrapper holds,
    ``blocks.i.block.*``, is the dense ``blocks.i.*``."""
    wrapped = [f"{name}.block" for name, module in moe_model.named_modules() if isinstance(module, MixtureOfDepths)]

    def dense_name(name: str) -> str:
        inner = next((w for w in wrapped if name == w or name.startswith(f"{w}.")), None)
        return name if inner is None else inner.removesuffix(".block") + name[len(inner) :]

    return dense_name


def architecture_differences(moe_model: nn.Module, dense: nn.Module) -> list[str]:
    """Where ``dense`` computes otherwise than ``moe_model`` beyond its weights: outside the MoE layers and
    Mixture-of-Depths routers, a module of another class or another value of an
    :data:`~moekit.models.architecture.ARCHITECTURE_FIELDS` setting (the attention's heads, say); in an MoE layer,
    experts whose activation is not that of the dense MLP they copy. One line per difference, naming the modules that
    have it (:func:`~moekit.models.architecture.setting_differences`)."""
    dense_name = _dense_names(moe_model)
    pairs = [
        *outside_routing(moe_model, dense, dense_name, ARCHITECTURE_FIELDS),
        *expert_activations(moe_model, dense, lambda name: f"{dense_name(name)}.act"),
    ]
    return setting_differences(pairs, ours="MoE", theirs="dense")


def _shape_check(bank: ExpertBank, mlp: nn.Module) -> None:
    """Raise ``load_dense_mlp``'s ``ValueError`` if ``mlp`` does not fit ``bank``, without writing to ``bank``."""
    probe = ExpertBank(
        1,
        bank.in_features,
        bank.hidden_features,
        bank.out_features,
        act_layer=None,
        gated=bank.gated,
        bias=(bank.fc1_bias is not None, bank.fc2_bias is not None),
        device="meta",
    )
    probe.load_dense_mlp(mlp)


def _glu_gate_last(moe_model: nn.Module, dense: nn.Module | None) -> dict[str, bool]:
    """Per MoE layer (``"<name>."``): whether the dense timm ``GluMlp`` there holds its gate in the second half of
    ``fc1`` (``gate_last``), which its weights do not tell: the dense model's own MLP at that name where the dense
    module is known, else that of the ``GluMlp`` blocks ``moe_model`` kept dense (its twin has the same MLPs), else
    timm's default (``gate_last=True``)."""
    kept = {m.gate_last for m in moe_model.modules() if isinstance(m, GluMlp)}
    default = kept.pop() if len(kept) == 1 else True
    dense_name, orders = _dense_names(moe_model), {}
    for name, _ in moe_layers(moe_model):
        try:
            mlp = dense.get_submodule(dense_name(name)) if dense is not None else None
        except AttributeError:
            mlp = None
        orders[f"{name}."] = mlp.gate_last if isinstance(mlp, GluMlp) else default
    return orders


def upcycle_vit(
    moe_model: nn.Module,
    dense: nn.Module | Mapping[str, Tensor],
    noise_std: float = 0.0,
    architecture: nn.Module | None = None,
) -> nn.Module:
    """Initialise ``moe_model`` (an MoE ViT from :func:`~moekit.models.create_moe_vit`) from a dense ViT.

    Args:
        moe_model: the MoE ViT, written in place.
        dense: the dense ViT of the same dims, its ``state_dict()``, or a timm checkpoint dict (wrapped
            in ``"model"`` / ``"state_dict"`` or in a layout timm's ViT checkpoint filter converts; as
            when timm loads pretrained weights, position embeddings and patch embeddings are resampled to
            ``moe_model``'s grid). Which half of a timm ``GluMlp``'s ``fc1`` is the gate (``gate_last``) is read from
            the dense module, or from the ``GluMlp`` blocks ``moe_model`` keeps dense, else timm's default.
        noise_std: std of Gaussian noise added to each expert copy to break their symmetry (0 = exact copies).
        architecture: where ``dense`` is weights, the dense model they belong to (built on the meta device, say,
            from the config it trained with), for the check of what its weights do not show
            (:func:`architecture_differences`: attention heads, norm epsilons, activations, pooling); a ``dense``
            module is checked itself.

    Returns:
        ``moe_model``. Its non-MoE weights equal the dense ones; each MoE layer's experts are copies of
        the dense MLP of that block. With top-k routing, gates that sum to one and no capacity limit, the
        upcycled model computes the dense model's function.

    Raises:
        ValueError: listing every missing key, unexpected key, shape mismatch and architecture difference, or naming
            the layers that the weights hold as MoE layers already; nothing is written then.
    """
    source = dense.state_dict() if isinstance(dense, nn.Module) else dict(dense)
    architecture = dense if isinstance(dense, nn.Module) else architecture
    return _upcycle(moe_model, checkpoint_filter_fn(source, moe_model), noise_std, "upcycle_vit", architecture)


def upcycle(
    moe_model: nn.Module,
    dense: nn.Module | Mapping[str, Tensor],
    noise_std: float = 0.0,
    architecture: nn.Module | None = None,
    caller: str = "upcycle",
) -> nn.Module:
    """Initialise ``moe_model`` from its dense twin (the same model with ``moe=None``, e.g. a
    :class:`~moekit.models.TransformerLM`): ``dense`` is that model or its ``state_dict()``. Arguments, result and
    errors as :func:`upcycle_vit`'s (``caller`` names the function in the errors)."""
    source = dense.state_dict() if isinstance(dense, nn.Module) else dict(dense)
    architecture = dense if isinstance(dense, nn.Module) else architecture
    return _upcycle(moe_model, source, noise_std, caller, architecture)


@torch.no_grad()
def _upcycle(
    moe_model: nn.Module,
    source: dict[str, Tensor],
    noise_std: float,
    caller: str,
    architecture: nn.Module | None,
) -> nn.Module:
    source, fresh_routers = _into_depth_blocks(moe_model, with_tied_names(moe_model, source))
    layers = {f"{name}.": layer for name, layer in moe_layers(moe_model)}
    if not layers and not fresh_routers:
        raise ValueError(f"{caller}: {type(moe_model).__name__} has no MoE layer to upcycle into")

    def moe_prefix(key: str):
        return next((prefix for prefix in layers if key.startswith(prefix)), None)

    already_moe = [prefix[:-1] for prefix in layers if f"{prefix}experts.fc1_weight" in source]
    if already_moe:
        raise ValueError(
            f"{caller}: the weights hold MoE layers already ({', '.join(already_moe)}), and upcycling starts an MoE "
            "model from a dense one; load MoE weights into the MoE model they were trained as "
            "(task.init_mode=finetune with the checkpoint's moe settings), or upcycle from its dense twin"
        )

    gate_last = _glu_gate_last(moe_model, architecture)
    target = moe_model.state_dict()
    missing = [k for k in target if moe_prefix(k) is None and k not in source]
    unexpected = [k for k in source if moe_prefix(k) is None and k not in target]
    problems = [
        f"{k}: dense {tuple(source[k].shape)} vs MoE {tuple(target[k].shape)}"
        for k in target
        if moe_prefix(k) is None and k in source and source[k].shape != target[k].shape
    ]
    dense_mlps = {}
    for prefix, layer in layers.items():
        entries = {k[len(prefix) :]: v for k, v in source.items() if k.startswith(prefix)}
        if not entries:
            missing.append(f"{prefix}* (the dense MLP of this MoE layer)")
            continue
        dense_mlps[prefix] = mlp = _dense_mlp(entries, prefix, unexpected)
        mlp.gate_last = gate_last[prefix]  # read by load_dense_mlp for a GluMlp's fused fc1
        try:
            _shape_check(layer.experts, mlp)
        except ValueError as err:
            problems.append(f"{prefix[:-1]}: {err}")
    differences = architecture_differences(moe_model, architecture) if architecture is not None else []
    if missing or unexpected or problems or differences:
        found = (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches", problems),
            ("architecture differences", differences),
        )
        raise ValueError(
            f"{caller}: the dense weights do not fit the MoE model: "
            + "; ".join(f"{what} {items}" for what, items in found if items)
            + ("; build the MoE model with the dense model's settings" if differences else "")
        )

    moe_model.load_state_dict({k: source[k] for k in target if moe_prefix(k) is None}, strict=False)
    for prefix, mlp in dense_mlps.items():
        layers[prefix].experts.load_dense_mlp(mlp, noise_std)
    if fresh_routers:
        log.info(
            "upcycled %s: the Mixture-of-Depths routers of %s start fresh",
            type(moe_model).__name__,
            ", ".join(fresh_routers),
        )
    if not dense_mlps:
        return moe_model
    log.info(
        "upcycled %s: the experts of %s copy the dense MLPs there (noise_std=%g), their routers (slots, shared "
        "experts) start fresh, every other weight is the dense model's",
        type(moe_model).__name__,
        ", ".join(prefix[:-1] for prefix in dense_mlps),
        noise_std,
    )
    return moe_model
