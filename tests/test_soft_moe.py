"""Soft MoE against the paper's equations (Puigcerver et al., Algorithm 1)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import reference_soft_moe
from moekit.moe import SoftMoE


def _layer(**kw):
    kw.setdefault("num_experts", 4)
    kw.setdefault("slots_per_expert", 2)
    return SoftMoE(8, 16, **kw)


def test_dispatch_columns_and_combine_rows_sum_to_one():
    layer = _layer()
    dispatch, combine = layer.routing_weights(torch.randn(3, 10, 8))
    assert dispatch.shape == combine.shape == (3, 10, 8)
    torch.testing.assert_close(dispatch.sum(dim=1), torch.ones(3, 8))  # per slot, over tokens
    torch.testing.assert_close(combine.sum(dim=2), torch.ones(3, 10))  # per token, over slots
    assert torch.all(combine > 0), "every token reaches every slot: nothing is dropped"


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("gated", [False, True])
def test_forward_equals_reference_algorithm(normalize, gated):
    layer = _layer(normalize=normalize, gated=gated, act_layer=nn.SiLU if gated else nn.GELU)
    with torch.no_grad():
        if normalize:
            layer.scale.fill_(3.0)  # a learned value, not just the init
    x = torch.randn(2, 10, 8)
    torch.testing.assert_close(layer(x), reference_soft_moe(layer, x), rtol=1e-4, atol=1e-5)


def test_logits_use_l2_normalised_tokens_and_phi_with_learned_scale():
    layer = _layer()
    with torch.no_grad():
        layer.scale.fill_(2.5)
    x = torch.randn(1, 5, 8)
    logits = layer.compute_logits(x)
    expected = F.normalize(x, dim=-1) @ (2.5 * F.normalize(layer.phi, dim=0))
    torch.testing.assert_close(logits, expected)
    # invariant to the scale of each token; |logit| <= scale
    torch.testing.assert_close(layer.compute_logits(7 * x), logits)
    assert logits.abs().max() <= 2.5 + 1e-5
    assert SoftMoE(8, 16).scale.item() == 1.0, "the scale is initialised to 1"
    assert layer.phi.shape == (8, 4 * 2), "Phi is [d, n * p]"


def test_logits_gradients_equal_those_of_normalising_the_tokens_first():
    # compute_logits divides X @ Phi by |X| instead of multiplying l2norm(X) by Phi: same values and gradients,
    # a zero token (padding) and one whose norm F.normalize's eps floors included
    layer = _layer()
    with torch.no_grad():
        layer.scale.fill_(1.7)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    x[0, 3] = 0
    x[1, 2] *= 1e-14  # |x| < 1e-12: the norm's gradient share is cut, as clamp_min cuts it in F.normalize
    layer.double()
    g = torch.randn(2, 6, 8, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    grads = []
    for x_, logits_fn in (
        (x1, layer.compute_logits),
        (x2, lambda t: F.normalize(t, dim=-1) @ (layer.scale * F.normalize(layer.phi, dim=0))),
    ):
        layer.zero_grad()
        logits = logits_fn(x_)
        (logits * g).sum().backward()
        grads.append((logits.detach(), x_.grad, layer.phi.grad.clone(), layer.scale.grad.clone()))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs)
    assert grads[0][0][0, 3].abs().max() == 0 and torch.isfinite(grads[0][1]).all()


def test_slots_are_weighted_averages_of_unnormalised_tokens():
    layer = _layer(num_experts=1, slots_per_expert=1)
    x = torch.randn(1, 6, 8) * 10
    dispatch, _ = layer.routing_weights(x)
    slots = dispatch[0].t() @ x[0]
    # each slot is a convex combination: inside the tokens' bounding box, in the raw token scale
    assert torch.all(slots <= x[0].max(0).values + 1e-5) and torch.all(slots >= x[0].min(0).values - 1e-5)
    expected = layer.experts(slots, 1)
    out = layer(x)
    torch.testing.assert_close(out[0], expected.expand(6, -1), rtol=1e-5, atol=1e-5)  # 1 slot: C = 1


def test_permutation_equivariance():
    layer = _layer()
    x = torch.randn(2, 10, 8)
    perm = torch.randperm(10)
    torch.testing.assert_close(layer(x[:, perm]), layer(x)[:, perm], rtol=1e-5, atol=1e-6)


def test_slots_from_capacity_factor():
    layer = SoftMoE(8, 16, num_experts=4, capacity_factor=1.0, num_tokens=16)
    assert layer.slots_per_expert == 4 and layer.num_slots == 16  # R(16 * 1.0 / 4)
    assert SoftMoE(8, 16, num_experts=4, capacity_factor=0.5, num_tokens=10).slots_per_expert == 1  # R(1.25)
    assert SoftMoE(8, 16, num_experts=64, capacity_factor=0.1, num_tokens=16).slots_per_expert == 1, "at least 1"
    with pytest.raises(ValueError, match="needs num_tokens"):
        SoftMoE(8, 16, num_experts=4, capacity_factor=1.0)
    with pytest.raises(ValueError, match="not both"):
        SoftMoE(8, 16, num_experts=4, slots_per_expert=2, capacity_factor=1.0, num_tokens=16)
    with pytest.raises(ValueError, match="slots_per_expert"):
        SoftMoE(8, 16, num_experts=4, slots_per_expert=0)


def test_padding_mask_excludes_padding_tokens():
    layer = _layer()
    real = torch.randn(1, 6, 8)
    padded = torch.cat([real, torch.randn(1, 3, 8) * 100], dim=1)
    mask = torch.tensor([[True] * 6 + [False] * 3])
    dispatch, combine = layer.routing_weights(padded, mask)
    assert torch.all(dispatch[0, 6:] == 0) and torch.all(combine[0, 6:] == 0)
    out = layer(padded, padding_mask=mask)
    torch.testing.assert_close(out[:, :6], layer(real), rtol=1e-5, atol=1e-6)
    assert torch.all(out[:, 6:] == 0)
    with pytest.raises(ValueError, match="padding_mask"):
        layer(padded, padding_mask=mask[:, :5])


def test_noise_only_in_training():
    layer = _layer(noise_std=1.0)
    x = torch.randn(2, 10, 8)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def test_gradients_reach_phi_scale_and_experts_gradcheck():
    layer = SoftMoE(4, 6, num_experts=2, slots_per_expert=2).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer(x), (x,))
    layer(x).sum().backward()
    for name in ("phi", "scale", "experts.fc1_weight", "experts.fc2_bias"):
        grad = layer.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_float32_routing_under_bf16_autocast():
    layer = _layer()
    x = torch.randn(2, 10, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer.compute_logits(x)
        dispatch, combine = layer.routing_weights(x)
        out = layer(x)
    assert logits.dtype == dispatch.dtype == combine.dtype == torch.float32
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), layer(x), rtol=0.05, atol=0.05)


def test_statistics_of_a_forward():
    layer = _layer()
    layer(torch.randn(2, 10, 8))
    stats = layer.stats
    assert stats["expert_load"].shape == (4,)
    torch.testing.assert_close(stats["expert_load"].sum(), torch.tensor(1.0))
    assert stats["dropped_fraction"] == 0
    assert 1.0 <= stats["tokens_per_slot"] <= 10.0
    assert 0 < stats["max_dispatch_weight"] <= 1


def test_bad_shapes_and_arguments():
    layer = _layer()
    with pytest.raises(ValueError, match=r"expected \[batch, tokens, 8\]"):
        layer(torch.randn(10, 8))
    with pytest.raises(ValueError, match=r"expected \[batch, tokens, 8\]"):
        layer(torch.randn(2, 10, 7))
    with pytest.raises(ValueError, match="num_experts"):
        SoftMoE(8, 16, num_experts=0)
    with pytest.raises(ValueError, match="noise_std"):
        SoftMoE(8, 16, noise_std=-1.0)
