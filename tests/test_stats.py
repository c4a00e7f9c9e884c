"""Routing statistics against hand-computed values on crafted routings."""

import math

import torch

from moekit.moe.stats import entropy, experts_choice_stats, soft_moe_stats, tokens_choice_stats


def test_tokens_choice_stats_hand_computed():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0]])
    gates = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.75, 0.25]])
    keep = torch.tensor([[True, True], [True, False], [False, False]])
    kept_counts = torch.tensor([2, 1, 0, 0])  # expert 0 twice, expert 1 once
    stats = tokens_choice_stats(probs, kept_counts, gates, keep)
    torch.testing.assert_close(stats["expert_load"], torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    counts = torch.tensor([2.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(stats["load_cv"], counts.std(unbiased=False) / counts.mean())
    assert stats["unused_experts"] == 0.5
    torch.testing.assert_close(stats["dropped_fraction"], torch.tensor(0.5))  # 3 of 6 assignments kept
    torch.testing.assert_close(stats["tokens_fully_dropped"], torch.tensor(1 / 3))
    h = [math.log(2), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(stats["router_entropy"], torch.tensor(sum(h) / 3))
    torch.testing.assert_close(stats["mean_top_gate"], torch.tensor((0.5 + 1.0 + 0.75) / 3))


def test_mean_top_gate_is_each_tokens_largest_gate_whatever_the_order_of_the_choices():
    """Loss-free balancing chooses by score + bias, so a token's first choice need not have its largest gate: a
    top-2 layer whose bias favours expert 0 puts the smaller gate first on many tokens."""
    from moekit.moe import TopKMoE

    probs = torch.tensor([[0.3, 0.6, 0.1], [0.5, 0.2, 0.3]])
    gates = torch.tensor([[0.3, 0.6], [0.5, 0.3]])  # token 0: expert 0 first (by its bias), expert 1's gate larger
    stats = tokens_choice_stats(probs, torch.tensor([1, 1, 0]), gates, torch.ones(2, 2, dtype=torch.bool))
    torch.testing.assert_close(stats["mean_top_gate"], torch.tensor((0.6 + 0.5) / 2))

    torch.manual_seed(0)
    layer = TopKMoE(4, 8, num_experts=4, top_k=2, bias_update_rate=0.001, capacity_factor=None)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))
    x = torch.randn(1, 64, 4)
    layer(x)
    gates = layer.router(x.reshape(64, 4)).gates
    assert (gates[:, 0] < gates[:, 1]).any(), "the bias must reorder some tokens' choices"
    torch.testing.assert_close(layer.stats["mean_top_gate"], gates.max(dim=-1).values.mean())


def test_experts_choice_stats_hand_computed():
    probs = torch.full((4, 2), 0.5)
    experts_per_token = torch.tensor([2, 0, 1, 1])
    gates = torch.tensor([[0.9, 0.1], [0.6, 0.2]])
    stats = experts_choice_stats(probs, experts_per_token, gates)
    assert stats["dropped_fraction"] == 0.25
    assert stats["mean_experts_per_token"] == 1.0
    torch.testing.assert_close(stats["router_entropy"], torch.tensor(math.log(2)))
    torch.testing.assert_close(stats["mean_top_gate"], torch.tensor(0.75))


def test_soft_moe_stats_hand_computed():
    # 1 sequence, 2 tokens, 2 experts x 1 slot
    dispatch = torch.tensor([[[1.0, 0.5], [0.0, 0.5]]])  # slot 0 takes token 0, slot 1 mixes both
    combine = torch.tensor([[[0.75, 0.25], [0.5, 0.5]]])
    stats = soft_moe_stats(dispatch, combine, num_experts=2, token_mask=None)
    torch.testing.assert_close(stats["dispatch_entropy"], torch.tensor(math.log(2) / 2))
    torch.testing.assert_close(stats["tokens_per_slot"], torch.tensor((1.0 + 2.0) / 2))
    torch.testing.assert_close(stats["max_dispatch_weight"], torch.tensor(0.75))
    torch.testing.assert_close(stats["max_combine_weight"], torch.tensor(0.625))
    torch.testing.assert_close(stats["expert_load"], torch.tensor([1.25 / 2, 0.75 / 2]))
    h_combine = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / 2 + math.log(2) / 2
    torch.testing.assert_close(stats["combine_entropy"], torch.tensor(h_combine))
    # a padding token is left out of the token averages
    masked = soft_moe_stats(dispatch, combine, 2, token_mask=torch.tensor([[True, False]]))
    torch.testing.assert_close(masked["max_combine_weight"], torch.tensor(0.75))
    torch.testing.assert_close(masked["expert_load"], torch.tensor([0.75, 0.25]))
    # a sequence of padding alone (its dispatch uniform over its padding) counts in no statistic
    both = soft_moe_stats(
        torch.cat([dispatch, torch.full_like(dispatch, 0.5)]),
        torch.cat([combine, torch.full_like(combine, 0.5)]),
        2,
        token_mask=torch.tensor([[True, False], [False, False]]),
    )
    for name, value in masked.items():
        torch.testing.assert_close(both[name], value, msg=name)


def test_entropy_ignores_zero_probabilities():
    torch.testing.assert_close(entropy(torch.tensor([0.0, 1.0])), torch.tensor(0.0))
    torch.testing.assert_close(entropy(torch.full((4,), 0.25)), torch.tensor(math.log(4)))
