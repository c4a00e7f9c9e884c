"""Drop-in use in timm, Hydra configs, the registry and the model-level helpers."""

from functools import partial

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from timm.layers import Mlp
from timm.models.vision_transformer import Block
from torch import nn

from moekit.moe import (
    ExpertsChoiceMoE,
    MoELayer,
    SoftMoE,
    TopKMoE,
    collect_moe_outputs,
    get_moe_layer,
    list_moe_layers,
    require_causal,
)


@pytest.mark.parametrize(
    "factory",
    [
        partial(SoftMoE, num_experts=4),
        partial(TopKMoE, num_experts=4, top_k=2, capacity_factor=1.25),
        partial(ExpertsChoiceMoE, num_experts=4),
    ],
)
def test_timm_block_takes_moe_layers_as_mlp_layer(factory):
    block = Block(dim=32, num_heads=4, mlp_ratio=2.0, mlp_layer=factory)
    assert isinstance(block.mlp, MoELayer)
    assert block.mlp.experts.hidden_features == 64, "hidden_features = dim * mlp_ratio, from the Block"
    x = torch.randn(2, 9, 32)
    y = block(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert block.mlp.experts.fc1_weight.grad is not None


def test_moe_layers_accept_every_timm_mlp_keyword():
    kwargs = dict(
        in_features=8,
        hidden_features=16,
        out_features=12,
        act_layer=nn.ReLU,
        norm_layer=None,
        bias=(True, False),
        drop=(0.0, 0.1),
        use_conv=False,
        device="cpu",
        dtype=torch.float32,
    )
    Mlp(**kwargs)  # the contract we mirror
    for name in list_moe_layers():
        extra = {"vocab_size": 10} if name == "hash" else {}
        layer = get_moe_layer(name)(**kwargs, **extra)
        assert layer.experts.fc1_bias is not None and layer.experts.fc2_bias is None
        assert layer.experts.drop2.p == 0.1
        assert layer.experts.fc2_weight.shape[-1] == 12


def test_hydra_and_python_construction_agree():
    cfg = OmegaConf.create(
        {
            "_target_": "moekit.moe.TopKMoE",
            "in_features": 8,
            "hidden_features": 16,
            "num_experts": 4,
            "top_k": 2,
            "capacity_factor": 1.5,
            "act_layer": "silu",
            "gated": True,
        }
    )
    torch.manual_seed(1)
    from_config = instantiate(cfg)
    torch.manual_seed(1)
    from_python = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.5, act_layer="silu", gated=True)
    assert str(from_config) == str(from_python)
    for (n1, p1), (n2, p2) in zip(from_config.named_parameters(), from_python.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_collect_moe_outputs_gathers_losses_and_stats_from_a_model():
    model = nn.Sequential(
        TopKMoE(8, 16, num_experts=4, top_k=1, switch_loss_weight=0.5, z_loss_weight=0.1),
        nn.GELU(),
        TopKMoE(8, 16, num_experts=4, top_k=2, switch_loss_weight=0.25),
        SoftMoE(8, 16, num_experts=2),
    )
    model(torch.randn(2, 6, 8))
    out = collect_moe_outputs(model)
    first, second = model[0].aux_losses, model[2].aux_losses
    torch.testing.assert_close(out.aux_losses["switch"], first["switch"] + second["switch"])
    torch.testing.assert_close(out.aux_loss, first["switch"] + first["z"] + second["switch"])
    assert set(out.layer_aux_losses) == {"0", "2"}
    assert set(out.stats) == {"0", "2", "3"}
    assert out.stats["3"]["dropped_fraction"] == 0
    assert all(not t.requires_grad for stats in out.stats.values() for t in stats.values())
    out.aux_loss.backward()
    assert model[0].router.weight.grad is not None
    empty = collect_moe_outputs(nn.Linear(2, 2))
    assert empty.aux_loss.item() == 0 and empty.stats == {}


def test_stats_can_be_turned_off():
    layer = TopKMoE(8, 16, num_experts=4, compute_stats=False)
    layer(torch.randn(1, 4, 8))
    assert layer.stats == {}


def test_require_causal_names_the_offending_layer():
    causal = nn.Sequential(TopKMoE(8, 16, num_experts=4), nn.Identity())
    require_causal(causal)
    mixed = nn.Sequential(TopKMoE(8, 16, num_experts=4), SoftMoE(8, 16, num_experts=2))
    with pytest.raises(ValueError, match=r"'1' \(SoftMoE\) is not causal"):
        require_causal(mixed)
    with pytest.raises(ValueError, match="not causal"):
        require_causal(TopKMoE(8, 16, num_experts=4, capacity_factor=1.0))


def test_registry():
    layers = {
        "soft_moe",
        "top_k",
        "experts_choice",
        "base",
        "hash",
        "dense_moe",
        "hierarchical",
        "strictly_balanced",
        "lory",
    }
    assert set(list_moe_layers()) == layers
    assert get_moe_layer("soft_moe") is SoftMoE
    with pytest.raises(ValueError, match="unknown MoE layer 'sofmoe'"):
        get_moe_layer("sofmoe")


def test_expert_rows_per_token():
    assert SoftMoE(8, 16, num_experts=4, slots_per_expert=2).expert_rows_per_token(16) == 0.5
    assert TopKMoE(8, 16, num_experts=4, top_k=2).expert_rows_per_token(16) == 2
    capped = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=0.5)
    assert capped.expert_rows_per_token(16) == 1.0  # capacity 4 per expert: at most 16 of 32 assignments
    shared = TopKMoE(8, 4, num_experts=8, top_k=2, num_shared_experts=2)
    assert shared.expert_rows_per_token(16) == 4.0
    assert ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=1.5).expert_rows_per_token(16) == 1.5
    for name in list_moe_layers():
        extra = {"vocab_size": 10} if name == "hash" else {}
        assert get_moe_layer(name)(8, 16, **extra).expert_rows_per_token(16) > 0
