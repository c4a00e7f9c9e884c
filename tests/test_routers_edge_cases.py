"""Edge cases of the less common routers: hash, strictly balanced, experts-choice, Soft MoE."""

import pytest
import torch

from moekit.moe import ExpertsChoiceMoE, HashMoE, SoftMoE, StrictlyBalancedMoE, collect_moe_outputs


# ----------------------------------------------------------------------------- hash
def test_frequency_hash_spreads_the_ids_the_corpus_never_shows():
    # 10 ids seen, 90 never: the unseen ids (count 0: no expert's count grows) go round the experts evenly
    # rather than all to the expert that happens to be lightest (a validation or generated token the training split
    # never showed would always meet that expert)
    layer = HashMoE(8, 16, num_experts=4, vocab_size=100, hash_method="frequency")
    counts = torch.zeros(100)
    counts[:10] = torch.arange(10, 0, -1).float()
    layer.router.fit_frequency(counts)
    table = layer.router.expert_of_token
    per_expert = torch.zeros(4).index_add_(0, table, counts)
    assert per_expert.tolist() == [15.0, 14.0, 13.0, 13.0]  # the greedy: 10 3 2 | 9 4 1 | 8 5 | 7 6
    assert torch.bincount(table, minlength=4).tolist() == [25, 25, 25, 25]


def test_hash_refuses_a_seed_that_is_not_an_int():
    with pytest.raises(ValueError, match="hash_seed='7' must be an int"):
        HashMoE(8, 16, num_experts=4, vocab_size=10, hash_seed="7")


def test_hash_names_ids_outside_its_vocabulary_and_routes_padding_whatever_its_id():
    """An id past vocab_size was torch's bare IndexError; padding may hold any id (a -100), it gets no expert."""
    layer = HashMoE(8, 16, num_experts=4, vocab_size=10)
    x = torch.randn(1, 3, 8)
    for ids, shown in (([1, 2, 10], "1 .. 10"), ([1, 2, -1], "-1 .. 2")):
        with pytest.raises(ValueError, match=rf"token ids {shown} given, outside its vocabulary 0 .. 9"):
            layer(x, token_ids=torch.tensor([ids]))
    mask = torch.tensor([[True, True, False]])
    out = layer(x, token_ids=torch.tensor([[1, 2, -100]]), padding_mask=mask)
    torch.testing.assert_close(out[:, :2], layer(x[:, :2], token_ids=torch.tensor([[1, 2]])))
    assert not out[0, 2].any()


# ----------------------------------------------------------------------------- strictly balanced
def test_strictly_balanced_thresholds_take_no_gradient_when_their_loss_is_off():
    # DDP (find_unused_parameters=False, configs/trainer/ddp.yaml) stops on a trainable parameter without a gradient
    for weight in (0.0, 1.0):
        layer = StrictlyBalancedMoE(8, 16, num_experts=4, top_k=2, threshold_loss_weight=weight).train()
        y = layer(torch.randn(2, 6, 8))
        (y.sum() + collect_moe_outputs(layer).aux_loss).backward()
        missing = [name for name, p in layer.named_parameters() if p.requires_grad and p.grad is None]
        assert missing == [], f"threshold_loss_weight={weight}: no gradient for {missing}"
        assert layer.has_thresholds()
    assert layer.thresholds.requires_grad


def test_strictly_balanced_thresholds_when_every_expert_takes_every_token():
    # top_k = num_experts: the batchwise mask gives every token every expert; so must the thresholds at inference
    torch.manual_seed(0)
    layer = StrictlyBalancedMoE(8, 16, num_experts=4, top_k=4).train()
    x = torch.randn(2, 5, 8)
    layer(x)
    layer.eval()
    scores = torch.softmax(x.reshape(10, 8) @ layer.router_weight.t(), -1)
    assert bool((scores > layer.thresholds.detach()).all())
    layer(x)
    torch.testing.assert_close(layer.stats["mean_experts_per_token"], torch.tensor(4.0))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_strictly_balanced_refuses_non_finite_loss_weights(value):
    for name in ("threshold_loss_weight", "z_loss_weight"):
        with pytest.raises(ValueError, match=f"{name}={value} must be a finite number >= 0"):
            StrictlyBalancedMoE(8, 16, num_experts=4, **{name: value})


# ----------------------------------------------------------------------------- experts-choice
@pytest.mark.parametrize("value", ["0.1", float("inf"), None])
def test_experts_choice_refuses_a_bad_z_loss_weight_with_its_value(value):
    with pytest.raises(ValueError, match=f"z_loss_weight={value!r} must be a finite number >= 0"):
        ExpertsChoiceMoE(8, 16, num_experts=4, z_loss_weight=value)


@pytest.mark.parametrize("group_size, tokens", [(8, 4), (3, 4), (4, 4)])
def test_experts_choice_rows_per_token_match_the_forward_when_groups_span_sequences(group_size, tokens):
    # model_summary passes the tokens of one sequence; a group of 8 holds two sequences of 4 (it reported 0 rows)
    layer = ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=1.5, group_size=group_size)
    x = torch.randn(6, tokens, 8).reshape(-1, 8)  # 24 tokens: whole groups of 8 and of 3
    token_idx = layer.route(x)[0]
    assert layer.expert_rows_per_token(tokens) == pytest.approx(token_idx.numel() / x.shape[0])


# ----------------------------------------------------------------------------- Soft MoE
def test_soft_moe_names_a_padding_mask_of_the_wrong_dtype():
    layer = SoftMoE(8, 16, num_experts=4)
    x = torch.randn(1, 3, 8)
    for mask in (torch.ones(1, 3), torch.ones(1, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match=f"padding_mask of shape \\(1, 3\\) and dtype {mask.dtype}"):
            layer(x, padding_mask=mask)
    with pytest.raises(ValueError, match=r"padding_mask of shape \(1, 2\)"):
        layer(x, padding_mask=torch.ones(1, 2, dtype=torch.bool))


def test_soft_moe_refuses_settings_of_the_wrong_type():
    with pytest.raises(ValueError, match="noise_std='0.1' must be a finite number >= 0"):
        SoftMoE(8, 16, num_experts=4, noise_std="0.1")
    with pytest.raises(ValueError, match="normalize='false' must be true or false"):
        SoftMoE(8, 16, num_experts=4, normalize="false")
