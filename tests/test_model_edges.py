"""Edge cases of the model summaries and the MoE ViTs, against hand computations and the rows the experts ran."""

from __future__ import annotations

import pytest
import timm
import torch

import moekit.models  # noqa: F401  (registers the models)
from moekit.models import TransformerLM
from moekit.models.summary import lm_summary, model_summary


def _rows_run(layer, run) -> tuple[object, int]:
    """``run()``'s result and the rows ``layer``'s routed experts took in it."""
    rows = []
    handle = layer.experts.register_forward_pre_hook(lambda module, inputs: rows.append(inputs[0].shape[0]))
    try:
        return run(), sum(rows)
    finally:
        handle.remove()


@pytest.mark.parametrize("batch, per_expert", [(1, 1), (3, 1), (16, 4)])
def test_a_position_balance_shares_the_experts_among_each_positions_tokens(batch, per_expert):
    """``balance_scope="position"``: each of 8 experts takes ``R(2 * batch / 8)`` of a position's ``batch`` tokens,
    ``8 * per_expert / batch`` rows per token (8 at batch 1), not the ``R(2 N / 8) * 8 / N`` of a batch-wide
    balance over all ``N`` tokens (about 2)."""
    moe = dict(recipe="strictly_balanced", num_experts=8, top_k=2, balance_scope="position")
    model = TransformerLM(vocab_size=50, max_seq_len=16, dim=16, depth=1, num_heads=2, moe=moe)
    layer = model.blocks[0].mlp
    summary, rows = _rows_run(layer, lambda: lm_summary(model, 16, batch_size=batch))
    (measured,) = summary.moe_layers
    assert rows == 16 * 8 * per_expert
    assert measured.expert_rows_per_token == pytest.approx(8 * per_expert / batch)
    assert measured.active_params_per_token == pytest.approx(measured.params_per_expert * 8 * per_expert / batch)


def test_shared_experts_count_their_own_parameters():
    """Two shared experts run as one MLP of twice the routed hidden size, with one output bias: a token uses the
    parameters of its 2 routed experts and that MLP's, ``d`` fewer than 4 routed experts'."""
    moe = dict(recipe="deepseek", num_experts=8, top_k=2, granularity=2, num_shared_experts=2)
    model = timm.create_model("vit_tiny_patch4_28", depth=1, embed_dim=32, num_heads=2, moe=moe, moe_blocks="all")
    layer = model.blocks[0].mlp
    routed = sum(p.numel() for p in layer.experts.parameters()) // 8
    shared = sum(p.numel() for p in layer.shared_experts.parameters())
    summary = model_summary(model, (1, 28, 28))
    (measured,) = summary.moe_layers
    assert measured.expert_rows_per_token == 4  # 2 routed + the shared MLP of 2 experts' width
    assert measured.active_params_per_token == 2 * routed + shared
    assert shared == 2 * routed - 32  # the one bias of 32 outputs less
    non_expert = summary.total_params - summary.expert_params
    assert summary.active_params_per_token == non_expert + 2 * routed + shared


@pytest.mark.parametrize("stem", ["patch", "conv"])
def test_padding_to_whole_patches_needs_a_resizable_position_embedding(stem):
    """30 px images in patches of 4: ``dynamic_img_pad`` alone pads them to 8 x 8 tokens, which timm's 7 x 7 position
    embedding cannot take (refused when built, with the fix); with ``dynamic_img_size`` too the Soft MoE layers size
    their slots for the 64 tokens that run, as for 32 px images."""
    kwargs = dict(depth=4, stem=stem, dynamic_img_pad=True)
    with pytest.raises(ValueError, match="dynamic_img_pad=True with dynamic_img_size=True"):
        timm.create_model("soft_moe_vit_tiny_patch4_28", img_size=30, **kwargs)
    padded = timm.create_model("soft_moe_vit_tiny_patch4_28", img_size=30, dynamic_img_size=True, **kwargs).eval()
    whole = timm.create_model("soft_moe_vit_tiny_patch4_28", img_size=32, depth=4)
    slots = [padded.blocks[i].mlp.num_slots for i in padded.moe_block_indices]
    assert slots == [whole.blocks[i].mlp.num_slots for i in whole.moe_block_indices] == [48, 48]
    with torch.no_grad():
        assert padded(torch.randn(2, 1, 30, 30)).shape == (2, 10)
    summary = model_summary(padded, (1, 30, 30))
    assert [layer.tokens for layer in summary.moe_layers] == [64, 64]
    assert [layer.expert_rows_per_token for layer in summary.moe_layers] == [48 / 64, 48 / 64]


def test_a_class_of_the_same_name_from_another_library_is_named_in_full():
    """torch's ``LayerNorm`` (eps 1e-5) in place of timm's (the ViT's, eps 1e-6) computes otherwise; the difference
    names both classes by module, not "LayerNorm vs LayerNorm"."""
    from moekit.models.architecture import checkpoint_differences

    model = timm.create_model("vit_tiny_patch4_28", depth=1, embed_dim=16, num_heads=2)
    trained = timm.create_model("vit_tiny_patch4_28", depth=1, embed_dim=16, num_heads=2, norm_layer=torch.nn.LayerNorm)
    (difference,) = checkpoint_differences(model, trained)
    assert difference.startswith(
        "class: checkpoint torch.nn.modules.normalization.LayerNorm vs model timm.layers.norm.LayerNorm (blocks.0.norm1"
    )
    assert (
        checkpoint_differences(model, timm.create_model("vit_tiny_patch4_28", depth=1, embed_dim=16, num_heads=2)) == []
    )
