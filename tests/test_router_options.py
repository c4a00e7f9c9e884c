"""Options of the gating networks: router jitter, zero-initialised routers, Bengio et al.'s losses in a router,
Eigen et al.'s dropping of overpowering experts, and the two-layer gate of the dense mixture."""

from __future__ import annotations

import pytest
import torch

from moekit.moe import DenseMoE, TopKMoE, routing
from moekit.moe.losses import bengio_batchwise_loss, bengio_examplewise_loss, bengio_variance_loss
from moekit.moe.routing import expert_softmax, router_logits


def test_jitter_scales_the_router_input_only_in_training():
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=1, jitter_eps=0.1)
    x = torch.randn(64, 8)
    clean = router_logits(x, layer.router.weight)
    layer.eval()
    torch.testing.assert_close(layer.router(x).probs, torch.softmax(clean, -1))
    layer.train()
    seen = []
    for _ in range(20):
        seen.append(layer.router(x).probs)
    assert not torch.allclose(seen[0], seen[1]), "fresh noise every training forward"
    # every logit is x*u W^T with u in [0.9, 1.1] per entry: |logit - clean| <= 0.1 * |x| @ |W|^T
    bound = 0.1 * x.abs() @ layer.router.weight.abs().t() + 1e-6
    for probs in seen:
        logits = torch.log(probs)
        shift = logits - torch.log(torch.softmax(clean, -1))  # log-softmax differences: logit deltas up to a constant
        delta = shift - shift.mean(-1, keepdim=True)
        assert torch.all(delta.abs() <= 2 * bound)
    with pytest.raises(ValueError, match=r"jitter_eps=1.5 must lie in \[0, 1\)"):
        TopKMoE(8, 16, jitter_eps=1.5)


def test_zero_router_init_gives_no_signal_and_noise_gives_exploration():
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, noisy_gating=True, router_init="zeros")
    assert torch.count_nonzero(layer.router.weight) == 0 and torch.count_nonzero(layer.router.noise_weight) == 0
    x = torch.randn(400, 8)
    layer.eval()
    torch.testing.assert_close(layer.router(x).probs, torch.full((400, 4), 0.25))
    layer.train()  # noise std softplus(0) = log 2: every expert is chosen, about equally often
    counts = torch.bincount(layer.router(x).expert_ids.reshape(-1), minlength=4).float()
    assert counts.min() > 0.8 * counts.mean()
    with pytest.raises(ValueError, match="router_init='normal'; allowed: 'default', 'zeros'"):
        TopKMoE(8, 16, router_init="normal")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_bengio_losses_in_the_router_equal_the_functions_on_its_scores(score_func):
    torch.manual_seed(0)
    weights = {"bengio_batchwise_loss_weight": 0.5, "bengio_variance_loss_weight": 0.25}
    if score_func == "sigmoid":
        weights["bengio_examplewise_loss_weight"] = 2.0
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, score_func=score_func, **weights).train()
    x = torch.randn(2, 10, 8)
    layer(x)
    logits = router_logits(x.reshape(20, 8), layer.router.weight)
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    target = 0.25 if score_func == "softmax" else 2 / 4
    assert layer.router.config.bengio_target == target
    expected = {
        "bengio_batchwise": 0.5 * bengio_batchwise_loss(scores, target),
        "bengio_variance": 0.25 * bengio_variance_loss(scores),
    }
    if score_func == "sigmoid":
        expected["bengio_examplewise"] = 2.0 * bengio_examplewise_loss(scores, target)
    assert layer.aux_losses.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(layer.aux_losses[name], value)


def test_bengio_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="softmax scores sum to 1 over the experts, so the examplewise loss"):
        TopKMoE(8, 16, bengio_examplewise_loss_weight=1.0)
    with pytest.raises(ValueError, match=r"bengio_target=0.5 must be 1/num_experts = 0.125 with softmax"):
        TopKMoE(8, 16, bengio_batchwise_loss_weight=1.0, bengio_target=0.5)
    with pytest.raises(ValueError, match=r"bengio_target=1.5 must be in \(0, 1\)"):
        TopKMoE(8, 16, score_func="sigmoid", bengio_target=1.5)


def _biased(layer, expert: int, bias: float) -> None:
    """Give every token a strong preference for ``expert`` (a router the first examples made overpowering)."""
    weight = layer.router.weight if isinstance(layer, TopKMoE) else layer.router_weight
    with torch.no_grad():
        weight.zero_()
        weight[expert, 0] = bias  # inputs below have x[:, 0] = 1


def _tokens(n: int = 64) -> torch.Tensor:
    x = torch.randn(1, n, 8)
    x[..., 0] = 1.0
    return x


@pytest.mark.parametrize("kind", ["top_k", "dense"])
def test_overpowering_experts_are_dropped_until_the_running_totals_are_balanced(kind):
    torch.manual_seed(0)
    margin = 2.0
    if kind == "top_k":
        layer = TopKMoE(8, 16, num_experts=4, top_k=1, normalize_gates=True, overpower_margin=margin)
    else:
        layer = DenseMoE(8, 16, num_experts=4, overpower_margin=margin, gate_hidden=None)
    _biased(layer, expert=0, bias=8.0)
    x = _tokens()
    layer.eval()
    reference = layer(x)
    layer.train()
    for _ in range(200):
        layer(_tokens())
    totals = (layer.router.overpowering if kind == "top_k" else layer.overpowering).gate_mass_total
    # 200 forwards of mass 1 each: without dropping expert 0 would hold ~200, the others ~0
    torch.testing.assert_close(totals.sum(), torch.tensor(200.0))
    assert totals.max() - totals.mean() <= margin + 1.0, totals  # ahead by at most the margin plus one forward
    assert totals.min() >= 200 / 4 - 2 * (margin + 1.0), totals  # every expert took its share
    layer.eval()
    torch.testing.assert_close(layer(x), reference, msg="nothing changes at inference")


def test_a_dropped_expert_gets_no_gate_and_the_softmax_is_renormalised():
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, overpower_margin=0.5).train()
    with torch.no_grad():
        layer.router.overpowering.gate_mass_total.copy_(torch.tensor([3.0, 0.0, 0.0, 1.0]))  # mean 1: drop 0
    x = torch.randn(30, 8)
    routing = layer.router(x)
    assert not (routing.expert_ids == 0).any()
    probs = torch.softmax(router_logits(x, layer.router.weight), -1)
    renormalised = probs[:, 1:] / probs[:, 1:].sum(-1, keepdim=True)
    torch.testing.assert_close(routing.gates, renormalised.gather(1, routing.expert_ids - 1))
    with pytest.raises(ValueError, match="overpower_margin=-1 must be a number >= 0"):
        TopKMoE(8, 16, overpower_margin=-1)


def test_a_dropped_expert_is_not_chosen_whatever_its_balancing_bias():
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=1, score_func="sigmoid", bias_update_rate=1e-3, overpower_margin=0.5)
    with torch.no_grad():
        layer.router.overpowering.gate_mass_total.copy_(torch.tensor([3.0, 0.0, 0.0, 1.0]))  # mean 1: drop 0
        layer.router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # the bias alone would pick expert 0
    routing = layer.train().router(torch.randn(30, 8))
    assert not (routing.expert_ids == 0).any()
    assert (layer.eval().router(torch.randn(30, 8)).expert_ids == 0).all(), "at inference nothing is dropped"


def test_two_layer_gate_of_the_dense_mixture():
    torch.manual_seed(0)
    layer = DenseMoE(8, 16, num_experts=3, gate_hidden=5)
    with torch.no_grad():
        layer.gate_hidden_bias.normal_()
        layer.router_bias.normal_()
    x = torch.randn(2, 4, 8)
    flat = x.reshape(8, 8)
    hidden = torch.relu(flat @ layer.gate_hidden_weight.t() + layer.gate_hidden_bias)
    gates = torch.softmax(hidden @ layer.router_weight.t() + layer.router_bias, -1)  # [N, E]
    expected = torch.einsum("ne,eno->no", gates, layer.experts(flat.repeat(3, 1), 8).view(3, 8, -1))
    torch.testing.assert_close(layer(x).reshape(8, -1), expected)
    assert {n for n, _ in layer.named_parameters()} >= {"gate_hidden_weight", "gate_hidden_bias", "router_bias"}
    with pytest.raises(ValueError, match="gate_hidden=0 must be a positive int"):
        DenseMoE(8, 16, gate_hidden=0)


@pytest.mark.parametrize("lanes", [16, 8, 0], ids=["avx512", "avx2", "other"])
def test_expert_softmax_is_torchs_softmax_padded_where_the_rows_are_short(lanes, monkeypatch):
    """Over the experts, float32 rows shorter than the CPU's float vector (and at least a quarter of it) are padded
    with -inf to a whole vector: the same values and gradients as ``torch.softmax``, for every number of experts."""
    monkeypatch.setattr(routing, "_cpu_float_lanes", lambda: lanes)
    pads, pad = [], torch.nn.functional.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda *a, **k: pads.append(a[0].shape[-1]) or pad(*a, **k))
    for experts in range(1, 21):
        logits = (torch.randn(3, 5, experts) * 4).requires_grad_()
        grad = torch.randn(3, 5, experts)
        scores = expert_softmax(logits)
        (got,) = torch.autograd.grad(scores, logits, grad)
        expected = torch.softmax(logits, dim=-1)
        torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got, torch.autograd.grad(expected, logits, grad)[0], rtol=1e-5, atol=1e-6)
        assert pads == ([experts] if experts < lanes <= 4 * experts else []), experts
        pads.clear()
    expert_softmax(torch.randn(4, 8, dtype=torch.float64))  # float64 rows: torch's kernel as they are
    assert not pads
