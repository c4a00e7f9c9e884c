"""The parameter and FLOP counts of the model summary against hand computations, where rounding or a class token
makes the per-sequence shortcut wrong."""

from __future__ import annotations

import pytest
import timm

import moekit.models  # noqa: F401  (registers the models)
from moekit.models.summary import lm_summary, model_summary

N, D, H = 49, 128, 512  # tokens, width and MLP hidden of the tiny 28 px models
MLP_FLOPS_PER_TOKEN = 2 * 2 * D * H


def test_experts_choice_rows_per_token_are_those_of_the_measured_batch():
    """Experts choose among all ``batch * tokens`` of a forward: 64 experts at capacity factor 2 over 2 images of
    49 tokens take ``R(98 * 2 / 64) = 3`` tokens each, 192 rows for 98 tokens (1.96 per token), which is what the
    FLOPs count. One image alone would round to ``R(1.53) = 2`` per expert, 2.61 rows per token: not what ran."""
    model = timm.create_model("vit_tiny_patch4_28", moe="experts_choice")
    summary = model_summary(model, (1, 28, 28), batch_size=2)
    rows = 3 * 64 / (2 * N)
    router = 2 * N * D * 64
    for layer in summary.moe_layers:
        assert layer.expert_rows_per_token == pytest.approx(rows)
        assert layer.flops_per_image == pytest.approx(rows * N * MLP_FLOPS_PER_TOKEN + router)
    per_expert = summary.moe_layers[0].params_per_expert
    non_expert = summary.total_params - summary.expert_params
    assert summary.active_params_per_token == pytest.approx(non_expert + 3 * rows * per_expert)


def test_a_class_token_counts_in_the_share_a_depth_routed_block_processes():
    """The class token always goes through a Mixture-of-Depths block: at capacity 0.25 of 49 patches the block
    processes 1 + 13 of the 50 tokens (28%), not 13 of 49 (26.5%)."""
    model = timm.create_model(
        "vit_tiny_patch4_28", class_token=True, global_pool="token", depth=2, mod=dict(capacity=0.25, blocks=[1])
    )
    summary = model_summary(model, (1, 28, 28))
    (block,) = summary.mod_blocks
    assert block.tokens == N and block.processed_fraction == pytest.approx(14 / 50)
    total = sum(p.numel() for p in model.parameters())
    block_params = sum(p.numel() for p in model.blocks[1].block.parameters())
    assert summary.active_params_per_token == pytest.approx(total - (1 - 14 / 50) * block_params)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: model_summary(m, (1, 28, 28), batch_size=0), r"input_size=\(1, 28, 28\), batch_size=0: give"),
        (lambda m: model_summary(m, 28), r"input_size=28, batch_size=2: give positive ints, \(C, H, W\)"),
        (lambda m: lm_summary(_lm(), 8, batch_size=0), r"seq_len=8 and batch_size=0 must be positive ints"),
    ],
)
def test_summary_arguments_are_checked_with_the_value_in_the_message(call, message):
    with pytest.raises(ValueError, match=message):
        call(timm.create_model("vit_tiny_patch4_28", depth=1))


def _lm():
    from moekit.models import TransformerLM

    return TransformerLM(vocab_size=20, max_seq_len=8, dim=16, depth=1, num_heads=2, moe=None)
