"""Mixture-of-Experts Vision Transformers on top of timm's ``VisionTransformer``.

:func:`create_moe_vit` builds an ordinary timm ``VisionTransformer`` and replaces ``blocks[i].mlp`` of
the chosen blocks with the MoE layer of a recipe (:mod:`moekit.recipes`), sized by the ``Mlp`` keywords
the block used (``in_features=embed_dim``, ``hidden_features=int(embed_dim * mlp_ratio)``, ``act_layer``,
``bias=proj_bias``, ``drop=proj_drop_rate``). Everything else - patch embedding, attention, pooling,
head, timm's forward, ``forward_features``, ``forward_intermediates`` - is timm's own.

Placement (``moe_blocks``): see :func:`~moekit.models.placement.resolve_moe_blocks` (``"second_half"``,
``"all"``, ``"every_<k>"``, ``"last_<n>"``, ``"every_<k>_last_<n>"`` or block indices).

Mixture-of-Depths (``mod``): the blocks of ``mod["blocks"]`` are wrapped in
:class:`~moekit.moe.MixtureOfDepths` (``model.blocks[i].block`` is then the timm block): each processes the
top-C patch tokens of its image, the prefix (class) tokens always.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Mapping
from typing import Any

from timm.layers import get_act_layer, to_2tuple
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from moekit.moe import DepthRouter, ExpertBank, MixtureOfDepths, build_moe_layer
from moekit.moe.cpu_matmul import adopt_linears
from moekit.moe.depth import capacity_tokens
from moekit.moe.dropout import use_fast_dropout
from moekit.recipes import check_fits, resolve_recipe
from moekit.recipes.depth import DepthSpec, resolve_depth

from .placement import MoEBlocks, resolve_moe_blocks

__all__ = ["EXPERT_INIT_STD", "create_moe_vit"]

EXPERT_INIT_STD = 0.02
"""Std of the truncated normal the experts start from: timm's ViT initialisation of its ``nn.Linear`` layers."""

_VIT_DEFAULTS: dict[str, Any] = {name: p.default for name, p in inspect.signature(VisionTransformer).parameters.items()}


def _check_patch_grid(img_size, patch_size) -> None:
    """Refuse an ``img_size`` the patches do not tile: timm sizes the position embedding for the whole patches, and
    the padded image of ``dynamic_img_pad`` alone has more tokens than it (``dynamic_img_size`` resizes it)."""
    for img, patch in zip(to_2tuple(img_size), to_2tuple(patch_size)):
        if img % patch:
            raise ValueError(
                f"img_size={img_size} is not divisible by patch_size={patch_size} ({img} % {patch} = {img % patch}); "
                "pick sizes that tile the image, or pass dynamic_img_pad=True with dynamic_img_size=True to pad it"
            )


def _patch_tokens(patch_embed: nn.Module) -> int:
    """The patch tokens of an ``img_size`` image: timm's ``num_patches``, or with ``dynamic_img_pad`` those of the
    image padded to whole patches."""
    if not getattr(patch_embed, "dynamic_img_pad", False):
        return patch_embed.num_patches
    return math.prod(-(-img // patch) for img, patch in zip(patch_embed.img_size, patch_embed.patch_size))


def create_moe_vit(
    *,
    moe: str | Mapping[str, Any] | None = "soft_moe",
    moe_blocks: MoEBlocks = "second_half",
    mod: DepthSpec | Mapping[str, Any] | None = None,
    **vit_kwargs: Any,
) -> VisionTransformer:
    """Build a timm ``VisionTransformer`` whose ``moe_blocks`` use the MoE layer of ``moe`` as their MLP.

    Args:
        moe: the MoE recipe: a name of :func:`moekit.recipes.list_recipes` (``"soft_moe"``, ``"switch"``, ...),
            a recipe mapping (``{"recipe": "switch", "num_experts": 8}``, or one with ``layer`` and the layer's
            settings), or None for the dense ViT. Soft MoE's ``num_tokens`` is the ViT's sequence length
            (patches + prefix tokens). Hash routing is refused: ViT blocks pass no token ids.
        moe_blocks: which blocks get the MoE layer, see :func:`resolve_moe_blocks`.
        mod: Mixture-of-Depths settings (:class:`~moekit.recipes.depth.DepthSpec`) or None: the blocks of
            ``mod["blocks"]`` process the top ``ceil(capacity * patches)`` tokens of each image (top-C in
            training and eval: a ViT is not causal).
        **vit_kwargs: ``timm.models.vision_transformer.VisionTransformer`` keywords (``img_size``,
            ``patch_size``, ``embed_dim``, ``depth``, ...).

    Returns:
        The ``VisionTransformer``, mapping images ``[B, in_chans, H, W]`` to logits ``[B, num_classes]``,
        with ``moe_block_indices`` and ``mod_block_indices``: the sorted indices of its MoE and
        Mixture-of-Depths blocks. Experts start from a normal of std
        :data:`EXPERT_INIT_STD` cut at two std (timm's MLPs: the same std, cut at +-2, far out: in effect uncut;
        ``fix_init`` rescales their fc2 as timm's). Its
        dropout layers draw their CPU masks as :mod:`moekit.moe.dropout` does, and its linear layers run float32
        CPU products on the library :mod:`moekit.moe.cpu_matmul` chooses.

    Raises:
        ValueError: an unknown recipe or placement, a recipe setting its layer does not take, ``img_size``
            not divisible by ``patch_size`` (unless ``dynamic_img_pad`` and ``dynamic_img_size``), or a ViT option
            MoE experts cannot follow (``scale_mlp_norm``).
    """
    spec = resolve_recipe(moe)
    depth_spec = resolve_depth(mod)
    for key in vit_kwargs:
        if key not in _VIT_DEFAULTS:
            close = difflib.get_close_matches(key, list(_VIT_DEFAULTS), n=1)
            hint = f"did you mean {close[0]}?" if close else "see timm's VisionTransformer for its keywords"
            raise ValueError(f"{key} is not a VisionTransformer keyword; {hint}")
    settings = {**_VIT_DEFAULTS, **vit_kwargs}
    if not (settings["dynamic_img_pad"] and settings["dynamic_img_size"]):
        _check_patch_grid(settings["img_size"], settings["patch_size"])
    model = VisionTransformer(**vit_kwargs)
    model.moe_block_indices = ()
    model.mod_block_indices = ()
    if depth_spec is not None:
        model.mod_block_indices = resolve_moe_blocks(
            depth_spec.blocks, settings["depth"], setting="mod.blocks", kind="routed"
        )
    if spec is not None:
        _replace_mlps(model, spec, moe_blocks, settings, depth_spec)
    for i in model.mod_block_indices:
        router = DepthRouter(model.embed_dim, depth_spec, causal=False, device=settings["device"])
        model.blocks[i] = MixtureOfDepths(model.blocks[i], router, prefix_tokens=model.num_prefix_tokens)
    return adopt_linears(use_fast_dropout(model))


def _replace_mlps(
    model: VisionTransformer, spec: Mapping[str, Any], moe_blocks: MoEBlocks, settings: dict, depth_spec
) -> None:
    """Put the MoE layer of ``spec`` in place of the MLP of the ``moe_blocks``; in a Mixture-of-Depths block
    it sees the prefix tokens and the top-C patches only (Soft MoE's ``num_tokens``)."""
    check_fits(spec, model="a ViT", causal=False, token_ids=False)
    block_ids = resolve_moe_blocks(moe_blocks, settings["depth"])
    if settings["scale_mlp_norm"]:
        raise ValueError("scale_mlp_norm=True puts a norm inside the MLP, which MoE experts lack; leave it False")
    mlp = dict(
        in_features=model.embed_dim,
        hidden_features=int(model.embed_dim * settings["mlp_ratio"]),
        act_layer=get_act_layer(settings["act_layer"]) or nn.GELU,
        bias=settings["proj_bias"],
        drop=settings["proj_drop_rate"],
        device=settings["device"],
        dtype=settings["dtype"],
    )
    patches, prefix = _patch_tokens(model.patch_embed), model.num_prefix_tokens
    for i in block_ids:
        block = model.blocks[i]
        if not hasattr(block, "mlp"):
            raise ValueError(f"block_fn {type(block).__name__} has no 'mlp' submodule to replace in block {i}")
        routed = i in model.mod_block_indices
        tokens = prefix + (capacity_tokens(depth_spec.capacity, patches) if routed else patches)
        block.mlp = build_moe_layer(spec, **mlp, model_settings={"num_tokens": tokens})
        # timm's fix_init divides the fc2 it would have drawn by sqrt(2 * (i + 1)); the experts follow it.
        out_std = EXPERT_INIT_STD / math.sqrt(2.0 * (i + 1)) if settings["fix_init"] else EXPERT_INIT_STD
        for bank in block.mlp.modules():
            if isinstance(bank, ExpertBank):
                bank.init_normal_(EXPERT_INIT_STD, out_std, truncate=True)
    model.moe_block_indices = block_ids
