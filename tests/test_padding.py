"""Padding masks: padding takes no capacity, gets no expert and counts in no loss or statistic, so the outputs, losses,
statistics and gradients of the real tokens do not change with the amount of padding around them."""

from __future__ import annotations

import copy

import pytest
import torch

from moekit.models import LSTMMoELM, TransformerLM
from moekit.moe import collect_moe_outputs, get_moe_layer
from moekit.moe.dispatch import plan_dispatch

DIM, HIDDEN, VOCAB = 8, 12, 40
LENGTHS = (7, 5, 2)  # real tokens of each sequence: padding of row 0 comes before row 1's tokens (flattened)

LAYERS = {
    "switch": ("top_k", dict(top_k=1, capacity_factor=1.0, switch_loss_weight=0.01, z_loss_weight=0.001)),
    "top2_position_priority": (
        "top_k",
        dict(top_k=2, capacity_factor=1.0, capacity_scope="position", batch_priority=True, switch_loss_weight=0.01),
    ),
    "top2_group": ("top_k", dict(top_k=2, capacity_factor=0.75, capacity_scope="group", group_size=4)),
    "mixtral": ("top_k", dict(top_k=2, normalize_gates=True, switch_loss_weight=0.01, z_loss_weight=0.001)),
    "deepseek": (
        "top_k",
        dict(
            top_k=2,
            score_func="sigmoid",
            normalize_gates=True,
            bias_update_rate=0.001,
            num_shared_experts=1,
            shared_expert_gate=True,
            switch_loss_weight=0.01,
            switch_loss_scope="global_batch",
        ),
    ),
    "noisy_top_k": ("top_k", dict(top_k=2, noisy_gating=True, importance_loss_weight=0.1, load_loss_weight=0.1)),
    "vmoe": (
        "top_k",
        dict(
            top_k=2,
            capacity_factor=1.0,
            noise_std=1.0,
            importance_over="probs",
            importance_loss_weight=0.005,
            load_loss_weight=0.005,
        ),
    ),
    "bengio": (
        "top_k",
        dict(
            top_k=2,
            score_func="sigmoid",
            bengio_batchwise_loss_weight=0.1,
            bengio_examplewise_loss_weight=0.1,
            bengio_variance_loss_weight=0.1,
            overpower_margin=0.5,
        ),
    ),
    "hash": ("hash", dict(vocab_size=VOCAB)),
    "base": ("base", {}),
    "hierarchical": (
        "hierarchical",
        dict(
            num_groups=2, top_k_groups=1, top_k=2, noisy_gating=True, importance_loss_weight=0.1, load_loss_weight=0.1
        ),
    ),
    "experts_choice": ("experts_choice", dict(capacity_factor=1.5, z_loss_weight=0.001)),
    "dense_moe": ("dense_moe", dict(z_loss_weight=0.001, overpower_margin=0.5)),
    "strictly_balanced": ("strictly_balanced", dict(top_k=2, z_loss_weight=0.001)),
    "strictly_balanced_position": ("strictly_balanced", dict(top_k=2, balance_scope="position")),
    "lory": ("lory", dict(segment_len=3, z_loss_weight=0.001)),
}


@pytest.fixture
def token_noise(monkeypatch):
    """Routers' noise as a function of the logits it perturbs: the same real token gets the same noise whatever the
    padding (``torch.randn_like`` draws depend on the number of tokens)."""
    monkeypatch.setattr(torch, "randn_like", lambda t, **kwargs: torch.sin(997.0 * t))


def _padded(x_real: list[torch.Tensor], ids_real: list[torch.Tensor], length: int, seed: int):
    """A batch of the sequences padded to ``length`` with random junk, and its mask."""
    junk = torch.Generator().manual_seed(seed)
    x = torch.randn(len(x_real), length, DIM, generator=junk) * 3
    ids = torch.randint(0, VOCAB, (len(x_real), length), generator=junk)
    mask = torch.zeros(len(x_real), length, dtype=torch.bool)
    for b, (xb, idb) in enumerate(zip(x_real, ids_real)):
        x[b, : len(xb)], ids[b, : len(xb)], mask[b, : len(xb)] = xb, idb, True
    return x, ids, mask


def _run(layer, x, ids, mask, train: bool):
    """Outputs of the real tokens, aux losses, statistics and the gradient reaching the real inputs."""
    layer = copy.deepcopy(layer).train(train)
    x = x.clone().requires_grad_(True)
    kwargs = {"token_ids": ids} if layer.registry_name == "hash" else {}
    out = layer(x, padding_mask=mask, **kwargs) if mask is not None else layer(x, **kwargs)
    real = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask
    weights = torch.linspace(-1, 1, out.shape[-1])
    objective = (out[real] * weights).sum() + sum(layer.aux_losses.values(), torch.zeros(()))
    objective.backward()
    stats = {k: v.clone() for k, v in layer.stats.items()}
    losses = {k: v.detach() for k, v in layer.aux_losses.items()}
    return out[real].detach(), out[~real].detach(), losses, stats, x.grad[real], x.grad[~real]


def _assert_same(first, second, what):
    out1, _, losses1, stats1, grad1, _ = first
    out2, _, losses2, stats2, grad2, _ = second
    torch.testing.assert_close(out1, out2, atol=1e-6, rtol=1e-5, msg=f"{what}: outputs")
    assert losses1.keys() == losses2.keys()
    for name in losses1:
        torch.testing.assert_close(losses1[name], losses2[name], atol=1e-7, rtol=1e-5, msg=f"{what}: loss {name}")
    assert stats1.keys() == stats2.keys()
    for name in stats1:
        torch.testing.assert_close(stats1[name], stats2[name], atol=1e-6, rtol=1e-5, msg=f"{what}: stat {name}")
    torch.testing.assert_close(grad1, grad2, atol=1e-6, rtol=1e-5, msg=f"{what}: gradients")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", sorted(LAYERS))
def test_real_tokens_do_not_see_the_amount_of_padding(case, train, token_noise):
    name, settings = LAYERS[case]
    torch.manual_seed(0)
    layer = get_moe_layer(name)(DIM, hidden_features=HIDDEN, num_experts=4, **settings)
    gen = torch.Generator().manual_seed(1)
    x_real = [torch.randn(n, DIM, generator=gen) for n in LENGTHS]
    ids_real = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    if name == "strictly_balanced" and not train:  # thresholds from a training batch first
        x, _, mask = _padded(x_real, ids_real, 9, seed=5)
        with torch.no_grad():
            layer.train()(x, padding_mask=mask)
    short = _run(layer, *_padded(x_real, ids_real, max(LENGTHS), seed=2), train)
    long = _run(layer, *_padded(x_real, ids_real, max(LENGTHS) + 6, seed=3), train)
    _assert_same(short, long, case)
    for result in (short, long):
        assert torch.all(result[1] == 0), f"{case}: padding got an expert"
        assert torch.all(result[5] == 0), f"{case}: padding got a gradient"


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_a_mask_of_real_tokens_only_changes_nothing(case, token_noise):
    """All tokens real: the masked path (capacity counted on device) equals the unmasked one."""
    name, settings = LAYERS[case]
    torch.manual_seed(0)
    layer = get_moe_layer(name)(DIM, hidden_features=HIDDEN, num_experts=4, **settings)
    x = torch.randn(3, 6, DIM)
    ids = torch.randint(0, VOCAB, (3, 6))
    _assert_same(_run(layer, x, ids, None, True), _run(layer, x, ids, torch.ones(3, 6, dtype=torch.bool), True), case)


def test_padding_takes_no_capacity():
    """Six tokens of which three are padding, all choosing expert 0 with capacity 2: the real ones keep it."""
    expert_ids = torch.zeros(6, 1, dtype=torch.long)
    valid = torch.tensor([False, True, False, True, False, True])
    plan = plan_dispatch(expert_ids, 2, capacity=2, valid=valid)
    assert plan.keep.squeeze(1).tolist() == [False, True, False, True, False, False]
    assert plan.counts.tolist() == [2, 0]


def test_a_bad_padding_mask_is_refused():
    layer = get_moe_layer("top_k")(DIM, hidden_features=HIDDEN, num_experts=4)
    with pytest.raises(ValueError, match=r"padding_mask of shape \(2, 5\).*\[batch, tokens\] = \[2, 6\]"):
        layer(torch.randn(2, 6, DIM), padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="dtype torch.int64"):
        layer(torch.randn(2, 6, DIM), padding_mask=torch.ones(2, 6, dtype=torch.long))


# --- whole language models --------------------------------------------------------------------------------------

LM_CASES = {
    "mixtral": dict(moe="mixtral"),
    "switch_position": dict(moe={"recipe": "switch", "num_experts": 4, "capacity_scope": "position"}),
    "top2_group": dict(moe={"recipe": "top2", "num_experts": 4, "capacity_scope": "group", "group_size": 4}),
    "lory": dict(moe={"recipe": "lory", "num_experts": 4, "segment_len": 4}),
    "mode": dict(moe="mixtral", mod={"capacity": 0.5, "blocks": "all"}),
    "dense": dict(moe=None),
}


def _lm_batch(length: int, seed: int):
    gen = torch.Generator().manual_seed(0)
    real = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 6, 3)]
    ids = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(3, length, dtype=torch.bool)
    for b, row in enumerate(real):
        ids[b, : len(row)], mask[b, : len(row)] = row, True
    return ids, mask


def _lm_run(model, length: int, seed: int, train: bool):
    model = copy.deepcopy(model).train(train)
    ids, mask = _lm_batch(length, seed)
    logits = model(ids, padding_mask=mask)
    moe = collect_moe_outputs(model)
    logits[mask].sum().backward() if train else None
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[mask].detach(), moe.aux_loss.detach(), grads


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", sorted(LM_CASES))
def test_transformer_lm_logits_do_not_see_the_padding(case, train):
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=VOCAB, max_seq_len=24, dim=16, depth=2, num_heads=2, **LM_CASES[case])
    short, long = _lm_run(model, 9, seed=1, train=train), _lm_run(model, 20, seed=2, train=train)
    torch.testing.assert_close(short[0], long[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(short[1], long[1], atol=1e-7, rtol=1e-5)
    assert short[2].keys() == long[2].keys()
    for name in short[2]:
        torch.testing.assert_close(short[2][name], long[2][name], atol=1e-5, rtol=1e-4, msg=name)


def test_lstm_lm_logits_do_not_see_the_padding():
    torch.manual_seed(0)
    moe = {"recipe": "switch", "num_experts": 4, "capacity_scope": "position"}
    model = LSTMMoELM(vocab_size=VOCAB, dim=16, dropout=0.0, moe=moe)
    short, long = _lm_run(model, 9, seed=1, train=True), _lm_run(model, 20, seed=2, train=True)
    torch.testing.assert_close(short[0], long[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(short[1], long[1])
