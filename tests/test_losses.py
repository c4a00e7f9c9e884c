"""Balancing losses against hand-computed values."""

import math

import pytest
import torch

from moekit.moe.losses import (
    batchwise_threshold_loss,
    bengio_batchwise_loss,
    bengio_examplewise_loss,
    bengio_variance_loss,
    cv_squared,
    importance_loss,
    load_loss,
    load_probabilities,
    router_z_loss,
    smooth_load,
    switch_load_balancing_loss,
    vmoe_load_loss,
    vmoe_load_probabilities,
)

GATES = torch.tensor([[0.25, 0.5, 0.0, 0.25], [0.7, 0.1, 0.1, 0.1], [0.3, 0.4, 0.2, 0.1]])


def test_switch_loss_hand_computed_example():
    top1 = GATES.argmax(dim=1)  # experts 1, 0, 1
    # f = [1/3, 2/3, 0, 0], P = [1.25/3, 1/3, 0.3/3, 0.45/3]: 4 * (1.25/9 + 2/9) = 13/9
    loss = switch_load_balancing_loss(GATES, top1, 4)
    torch.testing.assert_close(loss, torch.tensor(13 / 9))
    assert round(loss.item(), 2) == 1.44


def test_switch_loss_is_one_at_perfect_balance_and_n_at_collapse():
    uniform = torch.full((8, 4), 0.25)
    balanced_choice = torch.arange(8) % 4
    torch.testing.assert_close(switch_load_balancing_loss(uniform, balanced_choice, 4), torch.tensor(1.0))
    collapsed = torch.zeros(8, 4)
    collapsed[:, 2] = 1.0
    torch.testing.assert_close(switch_load_balancing_loss(collapsed, torch.full((8,), 2), 4), torch.tensor(4.0))
    # top-k counts every choice: a balanced top-2 routing is also 1
    top2 = torch.stack([torch.arange(8) % 4, (torch.arange(8) + 1) % 4], dim=1)
    torch.testing.assert_close(switch_load_balancing_loss(uniform, top2, 4), torch.tensor(1.0))


def test_cv_squared_and_importance_loss():
    values = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, population variance 3.5
    torch.testing.assert_close(cv_squared(values), torch.tensor(3.5 / 9))
    # importance = column sums of the gates: [1.25, 1.0, 0.3, 0.45]
    imp = torch.tensor([1.25, 1.0, 0.3, 0.45])
    expected = imp.var(unbiased=False) / imp.mean() ** 2
    torch.testing.assert_close(importance_loss(GATES), expected)
    assert cv_squared(torch.tensor([5.0])) == 0


def test_load_probabilities_hand_computed():
    # one token, three experts, k = 1
    clean = torch.tensor([[1.0, 0.0, 0.5]])
    noisy = torch.tensor([[1.2, 0.3, 0.1]])
    std = torch.tensor([[0.5, 1.0, 2.0]])
    probs = load_probabilities(clean, noisy, std, k=1)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    # expert 0 is in the top-1: threshold = 2nd largest noisy (0.3); others: threshold = largest (1.2)
    expected = torch.tensor([[phi((1.0 - 0.3) / 0.5), phi((0.0 - 1.2) / 1.0), phi((0.5 - 1.2) / 2.0)]])
    torch.testing.assert_close(probs, expected)
    torch.testing.assert_close(smooth_load(clean, noisy, std, 1), expected.sum(0))
    torch.testing.assert_close(load_loss(clean, noisy, std, 1), cv_squared(expected.sum(0)))


def test_vmoe_load_probabilities_hand_computed():
    # V-MoE, appendix A.2: one threshold per token, the k-th largest noisy logit over all experts
    clean = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.4, -1.0]])
    noisy = torch.tensor([[1.2, 0.3, 0.1], [0.1, 0.9, -0.5]])
    std = torch.full((2, 3), 0.25)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    # k = 2: thresholds 0.3 (token 0) and 0.1 (token 1); P = 1 - Phi((threshold - clean) / std)
    expected = torch.tensor(
        [
            [1 - phi((0.3 - 1.0) / 0.25), 1 - phi((0.3 - 0.0) / 0.25), 1 - phi((0.3 - 0.5) / 0.25)],
            [1 - phi((0.1 - 0.2) / 0.25), 1 - phi((0.1 - 0.4) / 0.25), 1 - phi((0.1 + 1.0) / 0.25)],
        ]
    )
    torch.testing.assert_close(vmoe_load_probabilities(clean, noisy, std, k=2), expected)
    torch.testing.assert_close(vmoe_load_loss(clean, noisy, std, 2), cv_squared(expected.sum(0)))
    # Shazeer's estimator differs: an expert inside the top-k is measured against the (k+1)-th logit
    assert not torch.allclose(load_probabilities(clean, noisy, std, 2), expected)


def test_smooth_load_matches_monte_carlo_selection_frequency():
    torch.manual_seed(0)
    clean = torch.randn(64, 6)
    std = torch.rand(64, 6) + 0.5
    noisy = clean + torch.randn(64, 6) * std
    # P(x, i) for expert i: resample only expert i's noise, keep the others fixed
    probs = load_probabilities(clean, noisy, std, k=2)
    draws = 20000
    i = 3
    resampled = noisy.unsqueeze(0).repeat(draws, 1, 1)
    resampled[:, :, i] = clean[:, i] + torch.randn(draws, 64) * std[:, i]
    in_top = (resampled.topk(2, dim=-1).indices == i).any(-1).float().mean(0)
    torch.testing.assert_close(probs[:, i], in_top, atol=0.02, rtol=0)


def test_router_z_loss():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = ((math.log(2.0)) ** 2 + (math.log(4.0)) ** 2) / 2
    torch.testing.assert_close(router_z_loss(logits), torch.tensor(expected))


@pytest.mark.parametrize("fn", ["importance", "z"])
def test_losses_are_differentiable(fn):
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    f = {"importance": lambda z: importance_loss(torch.softmax(z, -1)), "z": router_z_loss}[fn]
    assert torch.autograd.gradcheck(f, (logits,))


# Bengio et al. 2015 on three tokens x two experts, target rate 0.25.
SIGMA = torch.tensor([[0.9, 0.1], [0.5, 0.3], [0.1, 0.2]])


def test_bengio_batchwise_loss_hand_computed():
    # expert means over the batch: 0.5 and 0.2 -> |0.5 - 0.25| + |0.2 - 0.25|
    torch.testing.assert_close(bengio_batchwise_loss(SIGMA, 0.25), torch.tensor(0.25 + 0.05))


def test_bengio_examplewise_loss_hand_computed():
    # token means over the experts: 0.5, 0.4, 0.15 -> mean of |. - 0.25| = (0.25 + 0.15 + 0.1) / 3
    torch.testing.assert_close(bengio_examplewise_loss(SIGMA, 0.25), torch.tensor(0.5 / 3))


def test_bengio_variance_loss_hand_computed():
    # population variances per expert: 0.32 / 3 (values .9 .5 .1) and 0.02 / 3 (values .1 .3 .2)
    torch.testing.assert_close(bengio_variance_loss(SIGMA), torch.tensor(-(0.32 + 0.02) / 3))
    assert bengio_variance_loss(torch.full((4, 3), 0.3)) == 0, "the same policy for every token: no variance"


def test_batchwise_threshold_loss_hand_computed_and_zero_when_the_masks_agree():
    scores = torch.tensor([[0.6, 0.1], [0.3, 0.4], [0.2, 0.7]])
    batchwise = torch.tensor([[True, False], [True, False], [False, True]])  # each expert's top 1-2 tokens
    thresholds = torch.tensor([0.25, 0.5], requires_grad=True)
    # threshold mask: [[1, 0], [1, 0], [0, 1]] agrees everywhere -> 0
    assert batchwise_threshold_loss(scores, thresholds, batchwise) == 0
    # T = [0.35, 0.05]: expert 0 misses token 1 (batch takes it, 0.3 <= 0.35: term 0.35 - 0.3), expert 1 lets in
    # tokens 0 and 1 (0.1 - 0.05 and 0.4 - 0.05); the sum over tokens is averaged over the 3 tokens
    thresholds = torch.tensor([0.35, 0.05], requires_grad=True)
    loss = batchwise_threshold_loss(scores, thresholds, batchwise)
    torch.testing.assert_close(loss, torch.tensor((0.05 + 0.05 + 0.35) / 3))
    loss.backward()
    # dL/dT_e = -sum_n (M_threshold - M_batchwise)_ne / N: +1/3 for expert 0's missing token (descent lowers T_0),
    # -2/3 for expert 1's two extra tokens (descent raises T_1)
    torch.testing.assert_close(thresholds.grad, torch.tensor([1 / 3, -2 / 3]))
