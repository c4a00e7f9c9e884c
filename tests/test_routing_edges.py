"""Edge cases of tokens-choice routing checked against one-token-at-a-time references in float64."""

import torch

from moekit.moe import DenseMoE, TopKMoE


def _overpowered_layer(num_experts: int = 3, top_k: int = 1) -> TopKMoE:
    """A float64 top-k layer whose expert 0 has run ahead (margin 0), so training drops it."""
    layer = TopKMoE(2, 4, num_experts=num_experts, top_k=top_k, overpower_margin=0.0, dtype=torch.float64).train()
    with torch.no_grad():
        layer.router.overpowering.gate_mass_total.copy_(torch.tensor([1.0] + [0.0] * (num_experts - 1)))
    return layer


def test_dropping_an_expert_far_ahead_in_the_logits_keeps_finite_renormalised_gates():
    """With expert 0 dropped, a token whose logit for it is ~1000 above the others gets the softmax over the others'
    logits (their float64 scores next to expert 0's underflow to 0: renormalising them was 0 / 0)."""
    layer = _overpowered_layer()
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[400.0, 0.0], [0.0, 1.0], [-400.0, 0.0]]))  # [E, d]
    x = torch.tensor([[2.5, 0.0], [0.1, 0.3], [-1.0, 2.0]], dtype=torch.float64)  # [N, d]
    routing = layer.router(x)
    for n in range(x.shape[0]):
        logits = layer.router.weight[1:].detach() @ x[n]  # the kept experts 1 and 2
        scores = torch.softmax(logits, dim=0)
        best = int(scores.argmax())
        assert routing.expert_ids[n].tolist() == [best + 1]
        torch.testing.assert_close(routing.gates[n, 0], scores[best].detach())
    assert torch.isfinite(layer.router.overpowering.gate_mass_total).all()
    routing.gates.sum().backward()
    assert torch.isfinite(layer.router.weight.grad).all()


def test_a_forward_gone_nan_leaves_the_gate_mass_totals_finite():
    """A NaN token (a diverged step, which the non-finite guard skips) adds no mass: a NaN total would compare false
    with the margin and drop every expert, so every later forward would be NaN too."""
    layer = _overpowered_layer(num_experts=4, top_k=2)
    x = torch.randn(1, 6, 2, dtype=torch.float64)  # [B, T, d]
    bad = x.clone()
    bad[0, 2] = torch.nan
    layer(bad)
    totals = layer.router.overpowering.gate_mass_total
    assert torch.isfinite(totals).all(), totals
    assert torch.isfinite(layer(x)).all()


def test_a_float64_layer_drops_overpowering_experts_and_counts_their_gate_mass():
    """A float64 layer with ``overpower_margin`` (the totals stay float32) trains, each forward adding the mean over
    its real tokens of the gates each expert received."""
    torch.manual_seed(0)
    layer = TopKMoE(4, 8, num_experts=4, top_k=2, normalize_gates=True, overpower_margin=1.0, dtype=torch.float64)
    x = torch.randn(2, 5, 4, dtype=torch.float64)  # [B, T, d]
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])  # [B, T]
    layer.train()(x, padding_mask=mask).sum().backward()
    routing = layer.router.eval()(x.reshape(10, 4))  # the same choice and gates: nothing was dropped
    expected = torch.zeros(4, dtype=torch.float64)
    for n in mask.reshape(-1).nonzero().squeeze(1).tolist():
        for j in range(2):
            expected[routing.expert_ids[n, j]] += routing.gates[n, j].detach() / 8
    totals = layer.router.overpowering.gate_mass_total
    assert totals.dtype == torch.float32
    torch.testing.assert_close(totals.double(), expected, rtol=1e-6, atol=1e-7)


def test_a_dense_mixture_dropping_an_expert_far_ahead_in_the_logits_mixes_the_others_by_their_softmax():
    """DenseMoE with expert 0 dropped: the gates are the softmax over the kept experts' logits, finite where their
    scores next to expert 0's underflow to 0 (renormalising those was 0 / 0: a NaN output)."""
    layer = DenseMoE(2, 4, num_experts=3, overpower_margin=0.0, dtype=torch.float64).train()
    with torch.no_grad():
        layer.overpowering.gate_mass_total.copy_(torch.tensor([1.0, 0.0, 0.0]))
        layer.router_weight.copy_(torch.tensor([[400.0, 0.0], [0.0, 1.0], [-400.0, 0.0]]))  # [E, d]
    x = torch.tensor([[[2.5, 0.0], [0.1, 0.3], [-1.0, 2.0]]], dtype=torch.float64)  # [B, T, d]
    out = layer(x)
    x_N = x[0]
    expert_out = layer.experts(x_N.repeat(3, 1), 3).view(3, 3, -1).detach()  # [E, N, o]
    gates = torch.softmax(x_N @ layer.router_weight[1:].detach().T, dim=-1)  # [N, 2]: experts 1 and 2
    torch.testing.assert_close(out[0].detach(), torch.einsum("ne,eno->no", gates, expert_out[1:]))
    assert torch.isfinite(layer.overpowering.gate_mass_total).all()
    out.sum().backward()
    assert torch.isfinite(layer.router_weight.grad).all()
