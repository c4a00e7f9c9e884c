"""Mixture-of-Experts Vision Transformers on top of timm's ``VisionTransformer``.

:func:`create_moe_vit` builds an ordinary timm ``VisionTransformer`` and replaces ``blocks[i].mlp`` of
the chosen blocks with an MoE layer of :mod:`moekit.moe`, constructed with the ``Mlp`` keywords the
block used (``in_features=embed_dim``, ``hidden_features=int(embed_dim * mlp_ratio)``, ``act_layer``,
``bias=proj_bias``, ``drop=proj_drop_rate``). Everything else - patch embedding, attention, pooling,
head, timm's forward, ``forward_features``, ``forward_intermediates`` - is timm's own.

Placement (``moe_blocks``), for a ViT of ``depth`` blocks numbered ``0 .. depth - 1``:

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
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from timm.layers import get_act_layer, to_2tuple
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from moekit.moe import ExpertBank, HashMoE, get_moe_layer

__all__ = ["MoEBlocks", "EXPERT_INIT_STD", "resolve_moe_blocks", "create_moe_vit"]

MoEBlocks = str | Sequence[int]

EXPERT_INIT_STD = 0.02
"""Std of the truncated normal for expert weights: timm's ViT initialisation of its ``nn.Linear`` layers."""

_VIT_DEFAULTS: dict[str, Any] = {name: p.default for name, p in inspect.signature(VisionTransformer).parameters.items()}
_MLP_KEYWORDS = frozenset(
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
_PLACEMENT_FORMS = (
    "'second_half', 'all', 'every_<k>', 'last_<n>', 'every_<k>_last_<n>' (k, n >= 1) or a sequence of block indices"
)
_PLACEMENT_RE = re.compile(r"^(?:every_(?P<every>[1-9]\d*)(?:_last_(?P<last>[1-9]\d*))?|last_(?P<last_only>[1-9]\d*))$")


def _every_k(depth: int, k: int) -> list[int]:
    return [i for i in range(depth) if (depth - 1 - i) % k == 0]


def resolve_moe_blocks(moe_blocks: MoEBlocks, depth: int) -> tuple[int, ...]:
    """Turn a placement (see the module docstring) into sorted block indices in ``[0, depth)``.

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
                    f"moe_blocks={moe_blocks!r} asks for {last} MoE blocks but a ViT of depth={depth} has only "
                    f"{len(candidates)} such blocks"
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
        raise ValueError(f"moe_blocks={moe_blocks!r} selects no block; an MoE ViT needs at least one MoE block")
    return tuple(sorted(indices))


def _check_patch_grid(img_size, patch_size) -> None:
    for img, patch in zip(to_2tuple(img_size), to_2tuple(patch_size)):
        if img % patch:
            raise ValueError(
                f"img_size={img_size} is not divisible by patch_size={patch_size} ({img} % {patch} = {img % patch}); "
                "pick sizes that tile the image, or pass dynamic_img_pad=True to pad it"
            )


def _moe_layer_kwargs(layer_cls: type, moe_layer: str, num_experts: int | None, moe_kwargs) -> dict[str, Any]:
    """The MoE keywords for ``layer_cls``: ``moe_kwargs`` checked against its signature, plus
    ``num_experts`` and the ViT-style expert initialisation."""
    accepted = inspect.signature(layer_cls).parameters
    kwargs = dict(moe_kwargs or {})
    derived = sorted(_MLP_KEYWORDS & kwargs.keys())
    if derived:
        raise ValueError(
            f"moe_kwargs sets {derived}, which the builder takes from the ViT (embed_dim, mlp_ratio, act_layer, "
            "proj_bias, proj_drop_rate, device, dtype); set those as ViT keywords"
        )
    if "num_experts" in kwargs:
        raise ValueError("moe_kwargs sets num_experts; pass it as the num_experts argument instead")
    unknown = sorted(kwargs.keys() - accepted.keys())
    if unknown:
        allowed = sorted(accepted.keys() - _MLP_KEYWORDS - {"num_experts"})
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
        kwargs.setdefault("expert_init_std", EXPERT_INIT_STD)
    return kwargs


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
    layer_kwargs = _moe_layer_kwargs(layer_cls, moe_layer, num_experts, moe_kwargs)

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
