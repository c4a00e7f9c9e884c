"""timm registrations of the MoE ViTs (and the dense tiny ViTs to compare them with).

Importing :mod:`moekit.models` registers these names with timm, so ``timm.create_model(name, **overrides)``
builds them. Overrides: every ``VisionTransformer`` keyword (``img_size``, ``patch_size``, ``in_chans``,
``num_classes``, ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``, ``global_pool``,
``drop_path_rate``, ...), ``stem`` (``"patch"`` or ``"conv"``), ``moe_blocks`` and ``moe``: a recipe name
(:mod:`moekit.recipes`) or mapping that replaces the model's MoE, ``"none"`` for the dense model (timm drops
overrides that are None), or a mapping of settings only (``moe={"num_experts": 32}``) that changes the model's
own recipe. Every model's MoE is one of
the recipes, at most resized:

======================================  =====  =====  =====  =====  =============================================
name                                    input  width  depth  heads  MoE (recipe, placement)
======================================  =====  =====  =====  =====  =============================================
soft_moe_vit_small_patch16_224          3x224  384    12     6      soft_moe (128 experts x 1 slot), second half
soft_moe_vit_base_patch16_224           3x224  768    12     12     soft_moe (128 experts x 1 slot), second half
vmoe_vit_small_patch16_224              3x224  384    12     6      vmoe (top-2 of 32), every_2_last_5
ec_moe_vit_small_patch16_224            3x224  384    12     6      experts_choice (64 experts, cf 2), second half
soft_moe_vit_tiny_patch4_28             1x28   128    6      4      soft_moe, 16 experts (x 2 slots), second half
top2_moe_vit_tiny_patch4_28             1x28   128    6      4      top2, 8 experts, second half
ec_moe_vit_tiny_patch4_28               1x28   128    6      4      experts_choice, 8 experts, second half
soft_moe_vit_tiny_patch4_32             3x32   128    6      4      soft_moe, 16 experts (x 3 slots), second half
vit_tiny_patch4_28                      1x28   128    6      4      none: the dense twin
vit_tiny_patch4_32                      3x32   128    6      4      none: the dense twin
======================================  =====  =====  =====  =====  =============================================

The Soft MoE models follow the Soft MoE paper (global average pooling, no class token, MoE in the last
half; 128 slots for 196 tokens). The V-MoE model follows V-MoE's recipe on timm's ViT-S/16 dims (V-MoE's own
S is 512 wide and 8 deep) with a class token and MoE layers in the last 5 of every other block (3, 5, 7, 9,
11: V-MoE's Last-5). The experts-choice ImageNet model also keeps the class token. The tiny models (28 px,
e.g. MNIST: 49 patch tokens; 32 px, CIFAR-10: 64) use average pooling and no class token; their Soft MoE
layers size their slots from the tokens as the recipe does (0.653 slots per token).

Each cfg's preprocessing (mean, std, crop, interpolation: ``timm.data.resolve_data_config``) is the evaluation
transform of moekit's data for it: Fashion-MNIST, CIFAR-10, an ImageNet folder (``data=imagefolder``).
No cfg has weights; ``pretrained=True`` loads a local file given as
``pretrained_cfg_overlay=dict(file=path)`` (e.g. from :func:`moekit.models.export_safetensors`). For a
safetensors file the class count is read from its ``head.weight``, so a checkpoint exported with
``num_classes`` overridden loads with that same override.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from safetensors import SafetensorError, safe_open
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import register_model
from timm.models._builder import build_model_with_cfg
from timm.models._registry import generate_default_cfgs
from timm.models.vision_transformer import VisionTransformer, _cfg, checkpoint_filter_fn

from .stem import ConvStemPatchEmbed, MatmulPatchEmbed
from .vit import create_moe_vit

__all__: list[str] = []  # timm's register_model appends every registered name

FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


_FASHION_MNIST_CFG = dict(
    input_size=(1, 28, 28),
    num_classes=10,
    crop_pct=1.0,
    interpolation="bilinear",
    mean=FASHION_MNIST_MEAN,
    std=FASHION_MNIST_STD,
)
_CIFAR10_CFG = dict(
    input_size=(3, 32, 32), num_classes=10, crop_pct=1.0, interpolation="bilinear", mean=CIFAR10_MEAN, std=CIFAR10_STD
)
# What moekit's imagefolder data evaluates with (timm's create_transform defaults: resize to 256, centre crop 224,
# bilinear, ImageNet mean and std), not timm's ViT cfg (0.5 mean and std, crop 0.9, bicubic).
_IMAGENET_CFG = dict(crop_pct=0.875, interpolation="bilinear", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)

default_cfgs = generate_default_cfgs(
    {
        "soft_moe_vit_small_patch16_224": _cfg(**_IMAGENET_CFG),
        "soft_moe_vit_base_patch16_224": _cfg(**_IMAGENET_CFG),
        "vmoe_vit_small_patch16_224": _cfg(**_IMAGENET_CFG),
        "ec_moe_vit_small_patch16_224": _cfg(**_IMAGENET_CFG),
        "soft_moe_vit_tiny_patch4_28": _cfg(**_FASHION_MNIST_CFG),
        "top2_moe_vit_tiny_patch4_28": _cfg(**_FASHION_MNIST_CFG),
        "ec_moe_vit_tiny_patch4_28": _cfg(**_FASHION_MNIST_CFG),
        "soft_moe_vit_tiny_patch4_32": _cfg(**_CIFAR10_CFG),
        "vit_tiny_patch4_28": _cfg(**_FASHION_MNIST_CFG),
        "vit_tiny_patch4_32": _cfg(**_CIFAR10_CFG),
    }
)

_SMALL_16 = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
_BASE_16 = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
_AVG_POOL = dict(class_token=False, global_pool="avg")
_TINY_4 = dict(patch_size=4, embed_dim=128, depth=6, num_heads=4, **_AVG_POOL)

# Each MoE model: a recipe of moekit.recipes, at most resized, and its placement.
_SOFT_MOE = dict(moe=dict(recipe="soft_moe"))
_SOFT_MOE_TINY = dict(moe=dict(recipe="soft_moe", num_experts=16))
_VMOE = dict(moe=dict(recipe="vmoe"), moe_blocks="every_2_last_5")
_EC = dict(moe=dict(recipe="experts_choice"))
_TOP2_TINY = dict(moe=dict(recipe="top2", num_experts=8))
_EC_TINY = dict(moe=dict(recipe="experts_choice", num_experts=8))
_DENSE = dict(moe=None)


def _with_file_num_classes(overlay: dict[str, Any] | None) -> dict[str, Any] | None:
    """Add ``num_classes`` read from the head of a safetensors ``file`` to a pretrained cfg overlay
    (the cfg describes the checkpoint, and timm drops a checkpoint's head whose size differs from it)."""
    if not overlay or "num_classes" in overlay or not str(overlay.get("file", "")).endswith(".safetensors"):
        return overlay
    try:
        with safe_open(overlay["file"], framework="pt") as checkpoint:
            if "head.weight" not in checkpoint.keys():
                return overlay
            num_classes = checkpoint.get_slice("head.weight").get_shape()[0]
    except SafetensorError as err:
        raise ValueError(
            f"pretrained_cfg_overlay file={overlay['file']!r} is not a readable safetensors file ({err}); give one "
            "that moekit.models.export_safetensors or scripts/export.py wrote"
        ) from None
    return {**overlay, "num_classes": num_classes}


def _moe_override(default: Mapping[str, Any] | None, moe: Any) -> Any:
    """The MoE a user's ``moe=`` override means: settings alone (no ``recipe``/``layer``) change the model's
    own recipe; ``none`` (also as the mapping ``{"name": "none", ...}``) and anything else replaces it."""
    if isinstance(moe, Mapping) and "recipe" not in moe and "layer" not in moe and moe.get("name") != "none":
        if default is None:
            raise ValueError(f"moe={dict(moe)!r} changes settings of a dense model; name a recipe (moe='switch', ...)")
        return {**default, **moe}
    return moe


def _create(variant: str, pretrained: bool, vit_args: dict[str, Any], moe_args: dict[str, Any], **kwargs):
    """Build ``variant`` from its ViT and MoE defaults and the user's overrides with timm's builder
    (pretrained cfg, weight loading through timm's ViT checkpoint filter, ``features_only``).
    ``stem="patch"`` patchifies with :class:`~moekit.models.stem.MatmulPatchEmbed` (timm's ``PatchEmbed`` as one
    matmul), ``stem="conv"`` with :class:`~moekit.models.stem.ConvStemPatchEmbed` (``stem_channels``: its
    convolutions' channels)."""
    if "moe" in kwargs:
        moe_args = {**moe_args, "moe": _moe_override(moe_args["moe"], kwargs.pop("moe"))}
    kwargs = {**vit_args, **moe_args, **kwargs}
    stem = kwargs.pop("stem", "patch")
    stem_channels = kwargs.pop("stem_channels", None)
    if stem == "conv":
        kwargs["embed_layer"] = partial(ConvStemPatchEmbed, channels=stem_channels)
    elif stem_channels is not None:
        raise ValueError(
            f"stem_channels={stem_channels!r} needs stem='conv' (got stem={stem!r}); with stem={stem!r} set "
            "stem_channels=None (model.stem_channels=null)"
        )
    elif stem == "patch":
        kwargs["embed_layer"] = MatmulPatchEmbed
    else:
        raise ValueError(f"stem={stem!r}; allowed: 'patch' (timm's linear patchify), 'conv' (convolutional stem)")
    if pretrained:
        kwargs["pretrained_cfg_overlay"] = _with_file_num_classes(kwargs.get("pretrained_cfg_overlay"))
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        create_moe_vit,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


@register_model
def soft_moe_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Soft MoE S/16: ViT-S/16, average pooling, 128 experts x 1 slot in the last 6 of 12 blocks."""
    return _create("soft_moe_vit_small_patch16_224", pretrained, {**_SMALL_16, **_AVG_POOL}, _SOFT_MOE, **kwargs)


@register_model
def soft_moe_vit_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Soft MoE B/16: ViT-B/16, average pooling, 128 experts x 1 slot in the last 6 of 12 blocks."""
    return _create("soft_moe_vit_base_patch16_224", pretrained, {**_BASE_16, **_AVG_POOL}, _SOFT_MOE, **kwargs)


@register_model
def vmoe_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """V-MoE ViT-S/16: class token, top-2 of 32 experts (capacity 1.05) in blocks 3, 5, 7, 9, 11 (Last-5)."""
    return _create("vmoe_vit_small_patch16_224", pretrained, _SMALL_16, _VMOE, **kwargs)


@register_model
def ec_moe_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Experts-choice ViT-S/16: class token, 64 experts with capacity factor 2 in the last 6 of 12 blocks."""
    return _create("ec_moe_vit_small_patch16_224", pretrained, _SMALL_16, _EC, **kwargs)


@register_model
def soft_moe_vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Soft MoE ViT-Ti/4 for 1x28x28 (49 tokens): 16 experts x 2 slots in blocks 3-5 of 6."""
    return _create("soft_moe_vit_tiny_patch4_28", pretrained, _TINY_4, _SOFT_MOE_TINY, **kwargs)


@register_model
def top2_moe_vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Top-2 MoE ViT-Ti/4 for 1x28x28: the top2 recipe with 8 experts in blocks 3-5 of 6."""
    return _create("top2_moe_vit_tiny_patch4_28", pretrained, _TINY_4, _TOP2_TINY, **kwargs)


@register_model
def ec_moe_vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Experts-choice ViT-Ti/4 for 1x28x28: 8 experts, capacity factor 2 in blocks 3-5 of 6."""
    return _create("ec_moe_vit_tiny_patch4_28", pretrained, _TINY_4, _EC_TINY, **kwargs)


@register_model
def soft_moe_vit_tiny_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Soft MoE ViT-Ti/4 for 3x32x32 (CIFAR, 64 tokens): 16 experts x 3 slots in blocks 3-5 of 6."""
    return _create("soft_moe_vit_tiny_patch4_32", pretrained, _TINY_4, _SOFT_MOE_TINY, **kwargs)


@register_model
def vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Dense ViT-Ti/4 for 1x28x28, the twin of the tiny 28 px MoE models (timm has no 28 px ViT)."""
    return _create("vit_tiny_patch4_28", pretrained, _TINY_4, _DENSE, **kwargs)


@register_model
def vit_tiny_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Dense ViT-Ti/4 for 3x32x32, the twin of ``soft_moe_vit_tiny_patch4_32``."""
    return _create("vit_tiny_patch4_32", pretrained, _TINY_4, _DENSE, **kwargs)
