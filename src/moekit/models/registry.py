"""timm registrations of the MoE ViTs (and the dense tiny ViTs to compare them with).

Importing :mod:`moekit.models` registers these names with timm, so ``timm.create_model(name, **overrides)``
builds them. Overrides: every ``VisionTransformer`` keyword (``img_size``, ``patch_size``, ``in_chans``,
``num_classes``, ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``, ``global_pool``,
``drop_path_rate``, ...) and, for the MoE models, ``moe_layer``, ``moe_blocks``, ``num_experts`` and
``moe_kwargs`` (merged into the model's MoE defaults; a different ``moe_layer`` starts from that layer's
own defaults, number of experts included, instead).

======================================  =====  =====  =====  =====  ===============================================
name                                    input  width  depth  heads  MoE
======================================  =====  =====  =====  =====  ===============================================
soft_moe_vit_small_patch16_224          3x224  384    12     6      soft_moe, 128 experts x 1 slot, second half
soft_moe_vit_base_patch16_224           3x224  768    12     12     soft_moe, 128 experts x 1 slot, second half
vmoe_vit_small_patch16_224              3x224  384    12     6      top_k k=2, 32 experts, every_2_last_5
ec_moe_vit_small_patch16_224            3x224  384    12     6      experts_choice cf=1, 32 experts, second half
soft_moe_vit_tiny_patch4_28             1x28   128    6      4      soft_moe, 16 experts x 2 slots, second half
top2_moe_vit_tiny_patch4_28             1x28   128    6      4      top_k k=2 cf=1.25, 8 experts, second half
ec_moe_vit_tiny_patch4_28               1x28   128    6      4      experts_choice cf=2, 8 experts, second half
soft_moe_vit_tiny_patch4_32             3x32   128    6      4      soft_moe, 16 experts x 2 slots, second half
vit_tiny_patch4_28                      1x28   128    6      4      none: the dense twin (plain VisionTransformer)
vit_tiny_patch4_32                      3x32   128    6      4      none: the dense twin (plain VisionTransformer)
======================================  =====  =====  =====  =====  ===============================================

The Soft MoE models follow the Soft MoE paper (global average pooling, no class token, MoE in the last
half; 128 slots for 196 tokens). The V-MoE model follows V-MoE's recipe (class token, top-2 of 32
experts, capacity factor 1.05, Batch Prioritized Routing, experts starting as copies of one draw,
importance loss 0.005) on timm's ViT-S/16 dims (V-MoE's own S is 512 wide and 8 deep); V-MoE's
fixed-std router noise and its load loss (defined through that noise) have no equivalent in
:class:`~moekit.moe.TopKMoE` and are left out. The experts-choice ImageNet model also keeps the class
token. The tiny models (28 px, e.g. MNIST: 49 patch tokens; 32 px, CIFAR-10: 64) use average pooling
and no class token; their Soft MoE layers have 32 slots, the experts-choice one matches top-2's compute
(2 expert rows per token).

No cfg has weights; ``pretrained=True`` loads a local file given as
``pretrained_cfg_overlay=dict(file=path)`` (e.g. from :func:`moekit.models.export_safetensors`). For a
safetensors file the class count is read from its ``head.weight``, so a checkpoint exported with
``num_classes`` overridden loads with that same override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from safetensors import safe_open
from timm.models import register_model
from timm.models._builder import build_model_with_cfg
from timm.models._registry import generate_default_cfgs
from timm.models.vision_transformer import VisionTransformer, _cfg, checkpoint_filter_fn

from .stem import ConvStemPatchEmbed
from .vit import MoEBlocks, create_moe_vit

__all__: list[str] = []  # timm's register_model appends every registered name

FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@dataclass(frozen=True)
class MoEDefaults:
    """A registered model's MoE settings; ``moe_kwargs`` belong to ``moe_layer``."""

    moe_layer: str
    num_experts: int
    moe_blocks: MoEBlocks = "second_half"
    moe_kwargs: dict[str, Any] = field(default_factory=dict)

    def merge(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """Pop the MoE overrides out of ``overrides`` and return the :func:`create_moe_vit` MoE keywords."""
        moe_layer = overrides.pop("moe_layer", self.moe_layer)
        own_layer = moe_layer == self.moe_layer
        return dict(
            moe_layer=moe_layer,
            moe_blocks=overrides.pop("moe_blocks", self.moe_blocks),
            num_experts=overrides.pop("num_experts", self.num_experts if own_layer else None),
            moe_kwargs={**(self.moe_kwargs if own_layer else {}), **(overrides.pop("moe_kwargs", None) or {})},
        )


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

default_cfgs = generate_default_cfgs(
    {
        "soft_moe_vit_small_patch16_224": _cfg(),
        "soft_moe_vit_base_patch16_224": _cfg(),
        "vmoe_vit_small_patch16_224": _cfg(),
        "ec_moe_vit_small_patch16_224": _cfg(),
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

_SOFT_MOE = MoEDefaults("soft_moe", num_experts=128, moe_kwargs=dict(slots_per_expert=1))
_SOFT_MOE_TINY = MoEDefaults("soft_moe", num_experts=16, moe_kwargs=dict(slots_per_expert=2))
_VMOE = MoEDefaults(
    "top_k",
    num_experts=32,
    moe_blocks="every_2_last_5",
    moe_kwargs=dict(
        top_k=2, capacity_factor=1.05, batch_priority=True, importance_loss_weight=0.005, expert_init="shared"
    ),
)
_EC = MoEDefaults("experts_choice", num_experts=32, moe_kwargs=dict(capacity_factor=1.0))
_TOP2_TINY = MoEDefaults(
    "top_k",
    num_experts=8,
    moe_kwargs=dict(top_k=2, capacity_factor=1.25, normalize_gates=True, switch_loss_weight=0.01),
)
_EC_TINY = MoEDefaults("experts_choice", num_experts=8, moe_kwargs=dict(capacity_factor=2.0))


def _with_file_num_classes(overlay: dict[str, Any] | None) -> dict[str, Any] | None:
    """Add ``num_classes`` read from the head of a safetensors ``file`` to a pretrained cfg overlay
    (the cfg describes the checkpoint, and timm drops a checkpoint's head whose size differs from it)."""
    if not overlay or "num_classes" in overlay or not str(overlay.get("file", "")).endswith(".safetensors"):
        return overlay
    with safe_open(overlay["file"], framework="pt") as checkpoint:
        if "head.weight" not in checkpoint.keys():
            return overlay
        num_classes = checkpoint.get_slice("head.weight").get_shape()[0]
    return {**overlay, "num_classes": num_classes}


def _create(
    variant: str,
    pretrained: bool,
    vit_args: dict[str, Any],
    moe: MoEDefaults | None,
    **kwargs,
) -> VisionTransformer:
    """Build ``variant`` from its ViT and MoE defaults and the user's overrides with timm's builder
    (pretrained cfg, weight loading through timm's ViT checkpoint filter, ``features_only``).
    ``stem="conv"`` swaps the patchify projection for :class:`~moekit.models.stem.ConvStemPatchEmbed`."""
    kwargs = {**vit_args, **kwargs}
    stem = kwargs.pop("stem", "patch")
    if stem == "conv":
        kwargs["embed_layer"] = ConvStemPatchEmbed
    elif stem != "patch":
        raise ValueError(f"stem={stem!r}; allowed: 'patch' (timm's linear patchify), 'conv' (convolutional stem)")
    if moe is not None:
        kwargs.update(moe.merge(kwargs))
    if pretrained:
        kwargs["pretrained_cfg_overlay"] = _with_file_num_classes(kwargs.get("pretrained_cfg_overlay"))
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        VisionTransformer if moe is None else create_moe_vit,
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
    """V-MoE-style ViT-S/16: class token, top-2 of 32 experts (capacity 1.05, BPR) in blocks 3, 5, 7, 9, 11."""
    return _create("vmoe_vit_small_patch16_224", pretrained, _SMALL_16, _VMOE, **kwargs)


@register_model
def ec_moe_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Experts-choice ViT-S/16: class token, 32 experts with capacity factor 1 in the last 6 of 12 blocks."""
    return _create("ec_moe_vit_small_patch16_224", pretrained, _SMALL_16, _EC, **kwargs)


@register_model
def soft_moe_vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Soft MoE ViT-Ti/4 for 1x28x28 (49 tokens): 16 experts x 2 slots in blocks 3-5 of 6."""
    return _create("soft_moe_vit_tiny_patch4_28", pretrained, _TINY_4, _SOFT_MOE_TINY, **kwargs)


@register_model
def top2_moe_vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Top-2 MoE ViT-Ti/4 for 1x28x28: 8 experts, renormalised gates, capacity 1.25, Switch loss 0.01."""
    return _create("top2_moe_vit_tiny_patch4_28", pretrained, _TINY_4, _TOP2_TINY, **kwargs)


@register_model
def ec_moe_vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Experts-choice ViT-Ti/4 for 1x28x28: 8 experts, capacity factor 2 in blocks 3-5 of 6."""
    return _create("ec_moe_vit_tiny_patch4_28", pretrained, _TINY_4, _EC_TINY, **kwargs)


@register_model
def soft_moe_vit_tiny_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Soft MoE ViT-Ti/4 for 3x32x32 (CIFAR, 64 tokens): 16 experts x 2 slots in blocks 3-5 of 6."""
    return _create("soft_moe_vit_tiny_patch4_32", pretrained, _TINY_4, _SOFT_MOE_TINY, **kwargs)


@register_model
def vit_tiny_patch4_28(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Dense ViT-Ti/4 for 1x28x28, the twin of the tiny 28 px MoE models (timm has no 28 px ViT)."""
    return _create("vit_tiny_patch4_28", pretrained, _TINY_4, None, **kwargs)


@register_model
def vit_tiny_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """Dense ViT-Ti/4 for 3x32x32, the twin of ``soft_moe_vit_tiny_patch4_32``."""
    return _create("vit_tiny_patch4_32", pretrained, _TINY_4, None, **kwargs)
