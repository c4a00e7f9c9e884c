"""MoE ViTs on timm: placement, the builder, timm registration, summary, upcycling, export."""

import copy
import math

import pytest
import timm
import torch
from timm.layers import Mlp
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from moekit.models import (
    EXPERT_INIT_STD,
    create_moe_vit,
    export_safetensors,
    model_summary,
    resolve_moe_blocks,
    upcycle_vit,
)
from moekit.moe import (
    ExpertsChoiceMoE,
    MoELayer,
    SoftMoE,
    TopKMoE,
    collect_moe_outputs,
)

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=5)


def moe_block_indices(model: nn.Module) -> tuple[int, ...]:
    return tuple(i for i, block in enumerate(model.blocks) if isinstance(block.mlp, MoELayer))


# ------------------------------------------------------------------------------------------------
# Placement
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "moe_blocks, depth, expected",
    [
        ("second_half", 12, (6, 7, 8, 9, 10, 11)),
        ("second_half", 7, (3, 4, 5, 6)),
        ("all", 3, (0, 1, 2)),
        ("every_2", 12, (1, 3, 5, 7, 9, 11)),
        ("every_3", 7, (0, 3, 6)),
        ("every_1", 3, (0, 1, 2)),
        ("last_3", 12, (9, 10, 11)),
        ("last_1", 1, (0,)),
        ("every_2_last_5", 12, (3, 5, 7, 9, 11)),
        ("every_3_last_2", 12, (8, 11)),
        ([0, -1], 6, (0, 5)),
        ((4, 1), 6, (1, 4)),
    ],
)
def test_resolve_moe_blocks(moe_blocks, depth, expected):
    assert resolve_moe_blocks(moe_blocks, depth) == expected


@pytest.mark.parametrize(
    "moe_blocks, depth, message",
    [
        ("first_half", 12, r"moe_blocks='first_half' is not a placement; use 'second_half', 'all'"),
        ("every_0", 12, "is not a placement"),
        ("last_x", 12, "is not a placement"),
        ("every_2last_5", 12, "is not a placement"),
        (3, 12, "is not a placement"),
        ([0, 1.5], 12, "is not a placement"),
        ([True], 12, "is not a placement"),
        ([6], 6, r"moe_blocks index 6 is out of range for depth=6 \(allowed: -6 .. 5\)"),
        ([-7], 6, "index -7 is out of range"),
        ([1, -5], 6, "names a block twice"),
        (list(range(7)), 6, "names 7 MoE blocks but depth=6"),
        ("last_7", 6, "asks for 7 MoE blocks but a ViT of depth=6 has only 6"),
        ("every_2_last_4", 6, "asks for 4 MoE blocks but a ViT of depth=6 has only 3"),
        ([], 6, "selects no block"),
    ],
)
def test_resolve_moe_blocks_errors(moe_blocks, depth, message):
    with pytest.raises(ValueError, match=message):
        resolve_moe_blocks(moe_blocks, depth)


# ------------------------------------------------------------------------------------------------
# Builder
# ------------------------------------------------------------------------------------------------
def test_create_moe_vit_replaces_the_mlp_of_the_chosen_blocks():
    model = create_moe_vit(
        moe=dict(recipe="switch", num_experts=4, top_k=2),
        moe_blocks="every_2",
        mlp_ratio=2.0,
        act_layer="relu",
        proj_bias=False,
        **TINY,
    )
    assert isinstance(model, VisionTransformer)
    assert model.moe_block_indices == (1, 3) == moe_block_indices(model)
    assert all(isinstance(model.blocks[i].mlp, Mlp) for i in (0, 2))
    layer = model.blocks[3].mlp
    assert isinstance(layer, TopKMoE) and layer.num_experts == 4 and layer.top_k == 2
    assert (layer.capacity_factor, layer.eval_capacity_factor) == (1.25, 2.0), "the rest of the switch recipe"
    bank = layer.experts
    assert (bank.in_features, bank.hidden_features, bank.out_features) == (32, 64, 32), "the Block's Mlp sizes"
    assert isinstance(bank.act, nn.ReLU) and bank.fc1_bias is None and bank.fc2_bias is None
    # ViT-style expert init: truncated normal, std 0.02, cut at 2 std (as timm's trunc_normal_ for nn.Linear)
    assert bank.fc1_weight.abs().max() <= 2 * EXPERT_INIT_STD
    assert bank.fc1_weight.std().item() == pytest.approx(EXPERT_INIT_STD * 0.88, rel=0.1)

    logits = model(torch.randn(3, 3, 16, 16))
    assert logits.shape == (3, 5)
    moe = collect_moe_outputs(model)
    assert set(moe.stats) == {"blocks.1.mlp", "blocks.3.mlp"}
    (logits.sum() + moe.aux_loss).backward()
    assert bank.fc1_weight.grad is not None and layer.router.weight.grad is not None


def test_create_moe_vit_passes_the_token_count_to_soft_moe():
    model = create_moe_vit(moe=dict(recipe="soft_moe", num_experts=4, capacity_factor=1.0), **TINY)
    assert model.blocks[-1].mlp.slots_per_expert == round((16 + 1) / 4), "16 patches + the class token"


def test_create_moe_vit_granularity_divides_the_mlp_hidden_size():
    model = create_moe_vit(moe="deepseek", **TINY)  # MLP hidden 128, granularity 9
    layer = model.blocks[-1].mlp
    assert layer.experts.hidden_features == round(128 / 9) == layer.shared_experts.hidden_features
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_create_moe_vit_without_moe_is_timms_vit():
    torch.manual_seed(0)
    ours = create_moe_vit(moe=None, **TINY)
    torch.manual_seed(0)
    timms = VisionTransformer(**TINY)
    assert ours.moe_block_indices == () and moe_block_indices(ours) == ()
    assert ours.state_dict().keys() == timms.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), timms.state_dict().values()))


def test_create_moe_vit_fix_init_scales_the_experts_like_the_dense_fc2():
    def build(fix_init):
        torch.manual_seed(0)
        return create_moe_vit(moe=dict(recipe="soft_moe", num_experts=2), moe_blocks=[0, 2], fix_init=fix_init, **TINY)

    plain, fixed = build(False), build(True)
    for i in (0, 2):
        torch.testing.assert_close(
            fixed.blocks[i].mlp.experts.fc2_weight * math.sqrt(2 * (i + 1)), plain.blocks[i].mlp.experts.fc2_weight
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe="sofmoe"), r"unknown MoE recipe 'sofmoe'; recipes: base, deepseek, dense_moe"),
        (dict(moe="hash"), "recipe 'hash' routes each token by its token id, and a ViT has no token ids"),
        (dict(moe=dict(layer="sofmoe")), r"unknown MoE layer 'sofmoe'; registered layers: \['base', 'dense_moe'"),
        (dict(moe=dict(num_experts=4)), "names no layer; give a recipe name or a mapping with 'layer'"),
        (dict(moe_blocks="middle"), "moe_blocks='middle' is not a placement"),
        (dict(img_size=30), r"img_size=30 is not divisible by patch_size=4 \(30 % 4 = 2\)"),
        (dict(img_size=(16, 18)), r"img_size=\(16, 18\) is not divisible by patch_size=4"),
        (dict(moe=dict(recipe="soft_moe", in_features=8)), r"recipe 'soft_moe' sets \['in_features'\], which SoftMoE"),
        (dict(moe=dict(recipe="soft_moe", top_k=2)), r"sets \['top_k'\], which SoftMoE does not take; its settings: "),
        (
            dict(moe=dict(recipe="switch", top_k=200)),
            r"recipe 'switch': TopKMoE: top_k=200 must be an int in \[1, 128\]",
        ),
        (dict(moe=dict(recipe="deepseek", granularity=0)), r"granularity=0 must be a positive number"),
        (dict(scale_mlp_norm=True), "scale_mlp_norm=True"),
        (dict(embed_dimm=16), r"embed_dimm is not a VisionTransformer keyword; did you mean embed_dim\?"),
    ],
)
def test_create_moe_vit_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_moe_vit(**{**TINY, **kwargs})


# ------------------------------------------------------------------------------------------------
# timm registration
# ------------------------------------------------------------------------------------------------
SMALL_OVERRIDES = dict(depth=4, embed_dim=64, num_heads=2, img_size=32, moe={"num_experts": 4})


@pytest.mark.parametrize(
    "name, overrides, layer_type, blocks, input_shape, num_classes",
    [
        ("soft_moe_vit_small_patch16_224", SMALL_OVERRIDES, SoftMoE, (2, 3), (2, 3, 32, 32), 1000),
        ("soft_moe_vit_base_patch16_224", SMALL_OVERRIDES, SoftMoE, (2, 3), (2, 3, 32, 32), 1000),
        (
            "vmoe_vit_small_patch16_224",
            {**SMALL_OVERRIDES, "depth": 10},
            TopKMoE,
            (1, 3, 5, 7, 9),
            (2, 3, 32, 32),
            1000,
        ),
        ("ec_moe_vit_small_patch16_224", SMALL_OVERRIDES, ExpertsChoiceMoE, (2, 3), (2, 3, 32, 32), 1000),
        ("soft_moe_vit_tiny_patch4_28", {}, SoftMoE, (3, 4, 5), (2, 1, 28, 28), 10),
        ("top2_moe_vit_tiny_patch4_28", {}, TopKMoE, (3, 4, 5), (2, 1, 28, 28), 10),
        ("ec_moe_vit_tiny_patch4_28", {}, ExpertsChoiceMoE, (3, 4, 5), (2, 1, 28, 28), 10),
        ("soft_moe_vit_tiny_patch4_32", {}, SoftMoE, (3, 4, 5), (2, 3, 32, 32), 10),
        ("vit_tiny_patch4_28", {}, None, (), (2, 1, 28, 28), 10),
        ("vit_tiny_patch4_32", {}, None, (), (2, 3, 32, 32), 10),
    ],
)
def test_registered_models_build_and_run(name, overrides, layer_type, blocks, input_shape, num_classes):
    model = timm.create_model(name, **overrides)
    assert isinstance(model, VisionTransformer)
    assert moe_block_indices(model) == blocks
    assert getattr(model, "moe_block_indices", ()) == blocks
    assert all(type(model.blocks[i].mlp) is layer_type for i in blocks)
    assert model.pretrained_cfg["input_size"][0] == input_shape[1]
    logits = model(torch.randn(*input_shape))
    assert logits.shape == (input_shape[0], num_classes)
    moe = collect_moe_outputs(model)
    assert set(moe.stats) == {f"blocks.{i}.mlp" for i in blocks}


def test_tiny_models_share_the_dense_twins_dims():
    dense = timm.create_model("vit_tiny_patch4_28")
    assert (dense.embed_dim, len(dense.blocks), dense.blocks[0].attn.num_heads) == (128, 6, 4)
    assert dense.patch_embed.num_patches == 49 and dense.cls_token is None and dense.global_pool == "avg"
    moe = timm.create_model("top2_moe_vit_tiny_patch4_28")
    dense_keys = {k for k in dense.state_dict() if ".mlp." not in k}
    assert dense_keys == {k for k in moe.state_dict() if ".mlp." not in k}


def test_default_configs_of_the_imagenet_models():
    soft_s = timm.create_model("soft_moe_vit_small_patch16_224", device="meta")
    assert (soft_s.embed_dim, len(soft_s.blocks), soft_s.blocks[0].attn.num_heads) == (384, 12, 6)
    assert soft_s.patch_embed.patch_size == (16, 16) and soft_s.patch_embed.num_patches == 196
    assert soft_s.global_pool == "avg" and soft_s.cls_token is None and soft_s.num_classes == 1000
    assert soft_s.moe_block_indices == (6, 7, 8, 9, 10, 11)
    layer = soft_s.blocks[6].mlp
    assert isinstance(layer, SoftMoE) and layer.num_experts == 128 and layer.slots_per_expert == 1
    assert layer.experts.hidden_features == 4 * 384

    soft_b = timm.create_model("soft_moe_vit_base_patch16_224", device="meta")
    assert (soft_b.embed_dim, len(soft_b.blocks), soft_b.blocks[0].attn.num_heads) == (768, 12, 12)
    assert soft_b.moe_block_indices == (6, 7, 8, 9, 10, 11) and soft_b.blocks[-1].mlp.num_experts == 128

    vmoe = timm.create_model("vmoe_vit_small_patch16_224", device="meta")
    assert vmoe.moe_block_indices == (3, 5, 7, 9, 11) and vmoe.global_pool == "token"
    layer = vmoe.blocks[3].mlp
    assert (layer.num_experts, layer.top_k, layer.capacity_factor, layer.capacity.batch_priority) == (
        32,
        2,
        1.05,
        False,
    )
    assert layer.router.config.noise_std == 1.0 and layer.router.config.importance_over == "probs"
    assert layer.experts.init == "shared"

    ec = timm.create_model("ec_moe_vit_small_patch16_224", device="meta")
    assert ec.moe_block_indices == (6, 7, 8, 9, 10, 11)
    assert (ec.blocks[6].mlp.num_experts, ec.blocks[6].mlp.capacity_factor) == (64, 2.0)


def test_create_model_overrides_change_or_replace_the_recipe():
    model = timm.create_model(
        "soft_moe_vit_tiny_patch4_28",
        moe=dict(num_experts=4, capacity_factor=None, slots_per_expert=3),
        moe_blocks=[0, -1],
        mlp_ratio=2.0,
        drop_path_rate=0.1,
    )
    assert model.moe_block_indices == (0, 5)
    layer = model.blocks[0].mlp
    assert (layer.num_experts, layer.slots_per_expert, layer.experts.hidden_features) == (4, 3, 256)
    assert isinstance(model.blocks[5].drop_path2, nn.Module) and model.blocks[5].drop_path2.drop_prob > 0
    dropless = timm.create_model(
        "top2_moe_vit_tiny_patch4_28", moe=dict(capacity_factor=None, eval_capacity_factor=None)
    )
    assert dropless.blocks[3].mlp.capacity_factor is None and dropless.blocks[3].mlp.router.config.normalize_gates
    # another recipe replaces the model's (Soft MoE's slots do not carry over)
    switched = timm.create_model("soft_moe_vit_tiny_patch4_28", moe="switch")
    assert isinstance(switched.blocks[3].mlp, TopKMoE) and switched.blocks[3].mlp.top_k == 1
    assert switched.blocks[3].mlp.num_experts == 128, "the recipe's own expert count"
    dense = timm.create_model("soft_moe_vit_tiny_patch4_28", moe="none")  # timm drops None-valued overrides
    assert dense.moe_block_indices == () and moe_block_indices(dense) == ()
    with pytest.raises(ValueError, match="changes settings of a dense model; name a recipe"):
        timm.create_model("vit_tiny_patch4_28", moe=dict(num_experts=4))


def test_features_only():
    model = timm.create_model("soft_moe_vit_tiny_patch4_28", features_only=True, out_indices=(2, 5))
    features = model(torch.randn(2, 1, 28, 28))
    assert [tuple(f.shape) for f in features] == [(2, 128, 7, 7)] * 2


# ------------------------------------------------------------------------------------------------
# Summary
# ------------------------------------------------------------------------------------------------
N, D, H = 49, 128, 512  # tokens, width and MLP hidden of the tiny 28 px models


def dense_mlp_flops(tokens=N, dim=D, hidden=H):
    return 2 * tokens * dim * hidden * 2


@pytest.mark.parametrize(
    "channels, strides, widths",
    [
        (None, [2, 2], [1, 32, 64]),  # the default: doubling up to embed_dim // 2
        ([16, 48, 48, 24], [2, 2, 1, 1], [1, 16, 48, 48, 24]),  # two stride-1 convolutions at the 7 x 7 grid
    ],
)
def test_conv_stem_convolutions_follow_its_channels(channels, strides, widths):
    model = timm.create_model("vit_tiny_patch4_28", stem="conv", stem_channels=channels)
    convs = [m for m in model.patch_embed.proj if isinstance(m, nn.Conv2d)]
    assert [c.stride[0] for c in convs[:-1]] == strides and all(c.kernel_size == (3, 3) for c in convs[:-1])
    assert [c.in_channels for c in convs] == widths and convs[-1].kernel_size == (1, 1)
    assert convs[-1].out_channels == 128
    x = torch.randn(2, 1, 28, 28)
    tokens = model.patch_embed(x)
    assert tokens.shape == (2, 49, 128) and model.patch_embed.grid_size == (7, 7)
    # The centre token (3, 3) sees pixel rows 4q-3 .. 4q+3 of the two stride-2 convolutions at q = 3, and
    # each stride-1 convolution at the grid widens that by one token (4 px) on each side: rows 9-15, or 1-23.
    x.requires_grad_(True)
    model.patch_embed.eval()(x)[0, 3 * 7 + 3].sum().backward()
    rows = x.grad[0, 0].abs().sum(1).nonzero().flatten().tolist()
    extra = len(strides) - 2
    assert rows == list(range(4 * (3 - extra) - 3, 4 * (3 + extra) + 4)), rows


def test_conv_stem_runs_channels_last_with_the_values_and_gradients_of_nchw():
    model = timm.create_model("vit_tiny_patch4_28", stem="conv", stem_channels=[16, 32, 32]).train()
    stem = model.patch_embed.double()  # float64: no difference from the order of the sums
    convs = [m for m in stem.proj if isinstance(m, nn.Conv2d)]
    assert all(c.weight.is_contiguous() for c in convs), "contiguous parameters: FSDP2 shards no others"
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    seen = []
    hooks = [c.register_forward_hook(lambda m, i, o: seen.append(o.is_contiguous(memory_format=torch.channels_last)))
             for c in convs]  # fmt: skip
    ours = stem(x)
    # (a 1-channel image is in both layouts at once, and torch gives the first convolution an NCHW output)
    assert all(seen[1:]) and ours.is_contiguous(), "NHWC activations; the flatten to tokens a view"
    for h in hooks:
        h.remove()
    # The same stem as plain NCHW convolutions: equal tokens and gradients
    reference = copy.deepcopy(stem)
    for c in reference.proj:
        if isinstance(c, nn.Conv2d):
            c.__class__ = nn.Conv2d
    ref = reference.proj(x).flatten(2).transpose(1, 2)
    torch.testing.assert_close(ours, ref)
    g = torch.randn_like(ours)
    ours.backward(g)
    ref.backward(g)
    for a, b in zip(stem.parameters(), reference.parameters()):
        assert a.grad.is_contiguous()
        torch.testing.assert_close(a.grad, b.grad)


def test_a_conv_stem_vit_shards_with_fsdp2():
    # fully_shard takes contiguous parameters only: the stem's layout change happens inside its forward
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = timm.create_model("vit_tiny_patch4_28", stem="conv", stem_channels=[16, 32, 32], moe="switch")
    expected = copy.deepcopy(model)(torch.ones(2, 1, 28, 28))
    fully_shard(model)
    out = model(torch.ones(2, 1, 28, 28))
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    assert all(p.grad is not None for p in model.patch_embed.parameters())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stem="conv", stem_channels=[32]), r"stem channels=\[32\]: patch_size 4 needs at least 2 positive"),
        (dict(stem="conv", stem_channels=[32, 0]), r"stem channels=\[32, 0\]"),
        (dict(stem="patch", stem_channels=[32, 64]), r"stem_channels=\[32, 64\] needs stem='conv'"),
    ],
)
def test_conv_stem_errors_name_the_channels(kwargs, message):
    with pytest.raises(ValueError, match=message):
        timm.create_model("vit_tiny_patch4_28", **kwargs)


@pytest.mark.parametrize(
    "kwargs, hw",
    [
        (dict(img_size=32, patch_size=4, in_chans=3, embed_dim=24), (32, 32)),
        (dict(img_size=None, patch_size=(4, 8), in_chans=2, embed_dim=24, bias=False), (30, 35)),  # remainders
        (
            dict(img_size=32, patch_size=8, in_chans=3, embed_dim=24, strict_img_size=False, dynamic_img_pad=True),
            (27, 34),
        ),
    ],
)
def test_matmul_patch_embed_is_timms_patch_embed(kwargs, hw, monkeypatch):
    from timm.layers import PatchEmbed

    from moekit.models.stem import MatmulPatchEmbed, PatchProjection
    from moekit.moe.kernel_choices import PATCHIFY_KERNELS

    torch.manual_seed(0)
    ref = PatchEmbed(**kwargs).double()
    torch.manual_seed(0)
    ours = MatmulPatchEmbed(**kwargs).double()
    assert isinstance(ours.proj, PatchProjection)
    # the same parameters, drawn alike: checkpoints and seeded runs are timm's
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    x = torch.randn(3, kwargs["in_chans"], *hw, dtype=torch.float64, requires_grad=True)
    monkeypatch.setitem(PATCHIFY_KERNELS, "cpu", "matmul")  # the CUDA path, here on the CPU
    y, y_ref = ours(x), ref(x)
    torch.testing.assert_close(y, y_ref)
    assert y.is_contiguous(), "the flatten to [B, tokens, E] is a view"
    g = torch.randn_like(y)
    (x_grad,) = torch.autograd.grad(y, x, g, retain_graph=True)
    (x_grad_ref,) = torch.autograd.grad(y_ref, x, g, retain_graph=True)
    torch.testing.assert_close(x_grad, x_grad_ref)
    y.backward(g, inputs=list(ours.parameters()))
    y_ref.backward(g, inputs=list(ref.parameters()))
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    monkeypatch.setitem(PATCHIFY_KERNELS, "cpu", "conv")
    assert torch.equal(ours(x), y_ref), "the convolution where the table says so"


def test_matmul_patch_embed_keeps_the_matmul_through_timms_patch_resize(monkeypatch):
    from timm.layers import PatchEmbed

    from moekit.models.stem import MatmulPatchEmbed, PatchProjection
    from moekit.moe.kernel_choices import PATCHIFY_KERNELS

    monkeypatch.setitem(PATCHIFY_KERNELS, "cpu", "matmul")

    ref, ours = PatchEmbed(32, 8, 3, 16), MatmulPatchEmbed(32, 8, 3, 16)
    ours.load_state_dict(ref.state_dict())
    ref.set_input_size(patch_size=4)
    ours.set_input_size(patch_size=4)
    assert isinstance(ours.proj, PatchProjection) and ours.grid_size == ref.grid_size == (8, 8)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ours(x), ref(x))
    with pytest.raises(ValueError, match="kernel is its stride"):
        PatchProjection.of(nn.Conv2d(3, 8, 3, stride=3, padding=1))


def test_patch_stem_vits_patchify_by_matmul():
    from moekit.models.stem import MatmulPatchEmbed

    assert type(timm.create_model("vit_tiny_patch4_28").patch_embed) is MatmulPatchEmbed
    s16 = timm.create_model("soft_moe_vit_small_patch16_224", num_classes=3, device="meta")  # 923M parameters
    assert type(s16.patch_embed) is MatmulPatchEmbed


def test_summary_of_the_dense_tiny_vit_matches_the_hand_count():
    model = timm.create_model("vit_tiny_patch4_28")
    summary = model_summary(model, (1, 28, 28))
    attention = 2 * N * D * 3 * D + 2 * N * N * D * 2 + 2 * N * D * D  # qkv, QK^T and AV, proj
    expected = 2 * (1 * 4 * 4) * D * N + 6 * (attention + dense_mlp_flops()) + 2 * D * 10  # patches, blocks, head
    assert summary.flops_per_image == expected
    total = sum(p.numel() for p in model.parameters())
    assert summary.total_params == summary.active_params_per_token == total
    assert summary.expert_params == 0 and summary.moe_layers == ()
    assert "FLOPs / image" in str(summary) and model.training, "the model's mode is restored"


def test_summary_of_soft_moe_counts_slots_not_tokens():
    dense = model_summary(timm.create_model("vit_tiny_patch4_28"), (1, 28, 28))
    model = timm.create_model("soft_moe_vit_tiny_patch4_28")
    summary = model_summary(model, (1, 28, 28))
    slots = 16 * 2
    layer_flops = 3 * (2 * N * D * slots) + slots * dense_mlp_flops(tokens=1)  # logits, dispatch, combine; experts
    assert [s.flops_per_image for s in summary.moe_layers] == [layer_flops] * 3
    assert layer_flops < dense_mlp_flops(), "32 slots for 49 tokens: less MLP compute than the dense twin"
    assert summary.flops_per_image == dense.flops_per_image - 3 * (dense_mlp_flops() - layer_flops)
    first = summary.moe_layers[0]
    assert (first.name, first.layer, first.num_experts, first.tokens) == ("blocks.3.mlp", "soft_moe", 16, N)
    assert first.expert_rows_per_token == slots / N
    per_expert = 2 * D * H + H + D
    assert first.params_per_expert == per_expert and first.expert_params == 16 * per_expert
    assert summary.expert_params == 3 * 16 * per_expert
    non_expert = summary.total_params - summary.expert_params
    assert summary.active_params_per_token == pytest.approx(non_expert + 3 * per_expert * slots / N)
    assert dense.total_params == non_expert - 3 * (D * slots + 1) + 3 * per_expert, "dense MLP -> phi, scale, experts"
    assert "blocks.3.mlp" in summary.format() and "soft_moe" in str(summary)


def test_summary_of_dropless_top2_doubles_the_expert_flops():
    model = timm.create_model("top2_moe_vit_tiny_patch4_28", moe=dict(capacity_factor=None, eval_capacity_factor=None))
    summary = model_summary(model, (1, 28, 28))
    router, combine = 2 * N * D * 8, 2 * N * 2 * D  # logits for 8 experts; gate-weighted sum of 2 outputs
    assert [s.flops_per_image for s in summary.moe_layers] == [2 * dense_mlp_flops() + router + combine] * 3
    assert all(s.expert_rows_per_token == 2 for s in summary.moe_layers)
    per_expert = summary.moe_layers[0].params_per_expert
    non_expert = summary.total_params - summary.expert_params
    assert summary.active_params_per_token == non_expert + 3 * 2 * per_expert


# ------------------------------------------------------------------------------------------------
# Sparse upcycling
# ------------------------------------------------------------------------------------------------
def dropless_top2():
    return timm.create_model("top2_moe_vit_tiny_patch4_28", moe=dict(capacity_factor=None, eval_capacity_factor=None))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda dense: dense,
        lambda dense: dense.state_dict(),
        lambda dense: {"model": dense.state_dict()},
    ],
    ids=["module", "state_dict", "checkpoint"],
)
def test_upcycled_top2_vit_computes_the_dense_vit(wrap):
    dense = timm.create_model("vit_tiny_patch4_28").eval()
    moe = dropless_top2().eval()
    router_before = moe.blocks[4].mlp.router.weight.clone()
    assert upcycle_vit(moe, wrap(dense)) is moe
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), dense(x))
    bank, mlp = moe.blocks[4].mlp.experts, dense.blocks[4].mlp
    for e in range(bank.num_experts):
        torch.testing.assert_close(bank.fc1_weight[e], mlp.fc1.weight.t())
        torch.testing.assert_close(bank.fc2_bias[e], mlp.fc2.bias)
    torch.testing.assert_close(moe.blocks[4].mlp.router.weight, router_before, msg="routers stay fresh")


def test_upcycling_with_noise_breaks_the_expert_symmetry():
    dense = timm.create_model("vit_tiny_patch4_28")
    moe = upcycle_vit(timm.create_model("soft_moe_vit_tiny_patch4_28"), dense, noise_std=1e-3)
    weights = moe.blocks[3].mlp.experts.fc1_weight
    assert not torch.equal(weights[0], weights[1])
    torch.testing.assert_close(weights[0], dense.blocks[3].mlp.fc1.weight.t(), atol=1e-2, rtol=0)


def test_upcycling_refuses_a_dense_vit_of_other_heads_and_activation_with_weights_of_the_same_shapes():
    moe = dropless_top2()
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    with pytest.raises(ValueError) as info:
        upcycle_vit(moe, timm.create_model("vit_tiny_patch4_28", num_heads=2, act_layer="relu"))
    message = str(info.value)
    assert (
        "architecture differences ['num_heads: dense 2 vs MoE 4 (blocks.0.attn, blocks.1.attn, blocks.2.attn" in message
    )
    assert "'class: dense ReLU vs MoE GELU (blocks.0.mlp.act, blocks.1.mlp.act, blocks.2.mlp.act, " in message
    assert "blocks.3.mlp.experts.act, blocks.4.mlp.experts.act, blocks.5.mlp.experts.act)'" in message
    assert "shape" not in message and "missing" not in message
    assert all(torch.equal(v, before[k]) for k, v in moe.state_dict().items())


def test_upcycling_takes_a_dense_vit_that_differs_only_in_training_regularisation():
    """Stochastic depth, dropout and patch dropout are the identity in evaluation: a dense ViT trained with them
    upcycles into an MoE ViT without them, to the dense model's function."""
    dense = timm.create_model("vit_tiny_patch4_28", drop_path_rate=0.1, proj_drop_rate=0.1, patch_drop_rate=0.25)
    moe = upcycle_vit(dropless_top2(), dense.eval()).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), dense(x))


def test_upcycling_errors_list_the_offending_keys_and_write_nothing():
    moe = dropless_top2()
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    wider = timm.create_model("vit_tiny_patch4_28", mlp_ratio=2.0)
    with pytest.raises(ValueError, match=r"blocks.3.mlp: load_dense_mlp: dense MLP sizes fc1 \(256, 128\)"):
        upcycle_vit(moe, wider)
    state = timm.create_model("vit_tiny_patch4_28").state_dict()
    del state["head.weight"]
    state["extra.weight"] = torch.zeros(2, 2)
    state["blocks.5.mlp.norm.weight"] = torch.ones(512)  # timm's scale_mlp_norm: experts have no such norm
    state["blocks.0.attn.proj.bias"] = torch.zeros(7)
    with pytest.raises(ValueError) as info:
        upcycle_vit(moe, state)
    message = str(info.value)
    assert "missing keys ['head.weight']" in message
    assert "unexpected keys ['extra.weight', 'blocks.5.mlp.norm.weight (not a linear layer" in message
    assert "shape mismatches ['blocks.0.attn.proj.bias: dense (7,) vs MoE (128,)']" in message
    assert all(torch.equal(v, before[k]) for k, v in moe.state_dict().items())
    with pytest.raises(ValueError, match="has no MoE layer"):
        upcycle_vit(timm.create_model("vit_tiny_patch4_28"), state)


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, overrides, input_shape",
    [
        ("soft_moe_vit_tiny_patch4_28", dict(moe=dict(num_experts=4), depth=3), (3, 1, 28, 28)),
        (
            "vmoe_vit_small_patch16_224",
            dict(SMALL_OVERRIDES, depth=2, moe_blocks="last_1", num_classes=7),
            (3, 3, 32, 32),
        ),
    ],
)
def test_export_round_trip_through_timm_pretrained(tmp_path, name, overrides, input_shape):
    model = timm.create_model(name, **overrides).eval()
    path = export_safetensors(model, tmp_path / "weights" / "model.safetensors")
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"], "no temporary file left behind"
    loaded = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **overrides).eval()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    x = torch.randn(*input_shape)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    export_safetensors(loaded, path)  # overwrites in place
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"]
    # the class count comes from the file's head when not overridden
    arch = {k: v for k, v in overrides.items() if k != "num_classes"}
    from_file = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **arch)
    assert from_file.num_classes == model.num_classes


def test_export_and_pretrained_loading_errors_name_the_value(tmp_path):
    model = timm.create_model("vit_tiny_patch4_28", depth=1)
    with pytest.raises(ValueError, match=r"metadata \{'epoch': 3\}: a safetensors header holds strings only"):
        export_safetensors(model, tmp_path / "model.safetensors", metadata={"epoch": 3, "name": "ok"})
    assert not (tmp_path / "model.safetensors").exists()
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a safetensors file")
    with pytest.raises(ValueError, match=r"file='.*junk.safetensors' is not a readable safetensors file"):
        timm.create_model("vit_tiny_patch4_28", pretrained=True, pretrained_cfg_overlay=dict(file=str(junk)))


@pytest.mark.parametrize(
    "name, dataset, image_size",
    [
        ("soft_moe_vit_small_patch16_224", "imagefolder", (300, 260)),
        ("soft_moe_vit_base_patch16_224", "imagefolder", (300, 260)),
        ("vmoe_vit_small_patch16_224", "imagefolder", (300, 260)),
        ("ec_moe_vit_small_patch16_224", "imagefolder", (300, 260)),
        ("vit_tiny_patch4_32", "cifar10", (32, 32)),  # the dataset's own size: no resize
    ],
)
def test_a_models_timm_preprocessing_is_that_of_the_data_it_trains_on(name, dataset, image_size):
    """An exported model loaded with timm is fed as ``timm.data.resolve_data_config`` says: the transform of its
    cfg must prepare an image as moekit's evaluation split did in training (mean, std, resize, crop)."""
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    from moekit.data.datamodule import eval_images

    model = timm.create_model(name, device="meta")
    transform = create_transform(**resolve_data_config({}, model=model))
    pixels = torch.randint(256, (*image_size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    image = Image.fromarray(pixels.numpy())
    torch.testing.assert_close(
        transform(image), eval_images(dataset, [image], model.pretrained_cfg["input_size"][-1])[0]
    )
