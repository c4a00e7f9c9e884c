"""Mixture-of-Experts Vision Transformers on top of timm's ``VisionTransformer``.

:func:`create_moe_vit` builds an ordinary timm ``VisionTransformer`` and replaces ``blocks[i].mlp`` of
the chosen blocks with an MoE layer of :mod:`moekit.moe`, constructed with the ``Mlp`` keywords the
block used (``in_features=embed_dim``, ``hidden_features=int(embed_dim * mlp_ratio)``, ``act_layer``,
``bias=proj_bias``, ``drop=proj_drop_rate``). Everything else - patch embedding, attention, pooling,
head, timm's forward, ``forward_features``, ``forward_intermediates`` - is timm's own.

Placement (``moe_blocks``): see :func:`~moekit.models.placement.resolve_moe_blocks` (``"second_half"``,
``"all"``, ``"every_<k>"``, ``"last_<n>"``, ``"every_<k>_last_<n>"`` or block indices).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from timm.layers import get_act_layer, to_2tuple
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from moekit.moe import ExpertBank, HashMoE, get_moe_layer

from .placement import EXPERT_INIT_STD, MoEBlocks, moe_layer_kwargs, resolve_moe_blocks

__all__ = ["MoEBlocks", "EXPERT_INIT_STD", "resolve_moe_blocks", "create_moe_vit"]

_VIT_DEFAULTS: dict[str, Any] = {name: p.default for name, p in inspect.signature(VisionTransformer).parameters.items()}


def _check_patch_grid(img_size, patch_size) -> None:
    for img, patch in zip(to_2tuple(img_size), to_2tuple(patch_size)):
        if img % patch:
            raise ValueError(
                f"img_size={img_size} is not divisible by patch_size={patch_size} ({img} % {patch} = {img % patch}); "
                "pick sizes that tile the image, or pass dynamic_img_pad=True to pad it"
            )


def create_moe_vit(
    *,
    moe_layer: str = "soft_moe",
    moe_blocks: MoEBlocks = "second_half",
    num_experts: int | None = 8,
    moe_kwargs: Mapping[str, Any] | None = None,
    **vit_kwargs: Any,
) -> VisionTransformer:
    """Build a timm ``VisionTransformer`` whose ``moe_blocks`` use an MoE layer as their MLP.

    Args:
        moe_layer: registry name of the MoE layer (:func:`moekit.moe.list_moe_layers`), e.g.
            ``"soft_moe"``, ``"top_k"``, ``"experts_choice"``. ``"hash"`` is rejected: it routes by token
            id, which a ViT block does not pass to its MLP.
        moe_blocks: which blocks get the MoE layer, see :func:`resolve_moe_blocks`.
        num_experts: experts per MoE layer; None keeps the layer's default, and is required for layers
            sized otherwise (``"hierarchical"``: ``moe_kwargs`` ``num_groups`` / ``experts_per_group``).
        moe_kwargs: further keywords of the MoE layer (``slots_per_expert``, ``top_k``,
            ``capacity_factor``, ...). ``expert_init_std`` defaults to :data:`EXPERT_INIT_STD`, the
            std timm gives the dense MLP weights; Soft MoE's ``num_tokens`` defaults to the ViT's
            sequence length (patches + prefix tokens), so ``capacity_factor`` works without it.
        **vit_kwargs: ``timm.models.vision_transformer.VisionTransformer`` keywords (``img_size``,
            ``patch_size``, ``embed_dim``, ``depth``, ...).

    Returns:
        The ``VisionTransformer``, mapping images ``[B, in_chans, H, W]`` to logits ``[B, num_classes]``,
        with ``moe_block_indices``: the sorted indices of its MoE blocks.

    Raises:
        ValueError: unknown ``moe_layer`` or placement, bad ``moe_kwargs``, ``img_size`` not divisible
            by ``patch_size``, or a ViT option MoE experts cannot follow (``scale_mlp_norm=True``).
    """
    layer_cls = get_moe_layer(moe_layer)
    if issubclass(layer_cls, HashMoE):
        raise ValueError(
            f"moe_layer={moe_layer!r} routes by token id, which ViT blocks do not pass to their MLP; "
            "use a router that reads the tokens (e.g. 'top_k', 'soft_moe', 'experts_choice')"
        )
    settings = {**_VIT_DEFAULTS, **vit_kwargs}
    block_ids = resolve_moe_blocks(moe_blocks, settings["depth"])
    if not settings["dynamic_img_pad"]:
        _check_patch_grid(settings["img_size"], settings["patch_size"])
    if settings["scale_mlp_norm"]:
        raise ValueError("scale_mlp_norm=True puts a norm inside the MLP, which MoE experts lack; leave it False")
    layer_kwargs = moe_layer_kwargs(layer_cls, moe_layer, num_experts, moe_kwargs)

    model = VisionTransformer(**vit_kwargs)
    if "num_tokens" in inspect.signature(layer_cls).parameters:
        layer_kwargs.setdefault("num_tokens", model.patch_embed.num_patches + model.num_prefix_tokens)
    mlp_kwargs = dict(
        in_features=model.embed_dim,
        hidden_features=int(model.embed_dim * settings["mlp_ratio"]),
        act_layer=get_act_layer(settings["act_layer"]) or nn.GELU,
        bias=settings["proj_bias"],
        drop=settings["proj_drop_rate"],
        device=settings["device"],
        dtype=settings["dtype"],
    )
    for i in block_ids:
        block = model.blocks[i]
        if not hasattr(block, "mlp"):
            raise ValueError(f"block_fn {type(block).__name__} has no 'mlp' submodule to replace in block {i}")
        block.mlp = layer_cls(**mlp_kwargs, **layer_kwargs)
        if settings["fix_init"]:  # timm scaled the dense fc2 it replaced by this factor
            for bank in block.mlp.modules():
                if isinstance(bank, ExpertBank):
                    with torch.no_grad():
                        bank.fc2_weight.div_(math.sqrt(2.0 * (i + 1)))
    model.moe_block_indices = block_ids
    return model
