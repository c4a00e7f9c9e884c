"""The MoE layers in reduced and extended precision: bf16 / fp16 autocast and layers cast to bf16, fp16 or float64
(``layer.to(torch.bfloat16)``, Lightning's ``bf16-true`` / ``64-true``): every recipe runs and stays within the
precision's rounding of the float32 layer, the routers and losses stay float32 (float64 in a float64 layer), state
counted outside autograd keeps float32, and a float64 layer computes in float64 throughout (gradcheck)."""

import moekit  # noqa: F401, I001 - before torch, as the scripts do
import pytest
import torch
from torch.func import functional_call

from moekit.moe import DenseMoE, LoryMoE, TopKMoE, build_moe_layer, update_balancing_biases
from moekit.recipes import resolve_recipe

RECIPES = [
    "base",
    "deepseek",
    "dense_moe",
    "experts_choice",
    "hash",
    "hierarchical",
    "lory",
    "mixtral",
    "noisy_top_k",
    "soft_moe",
    "strictly_balanced",
    "switch",
    "top2",
    "vmoe",
]
D, H, B, T, V = 16, 32, 2, 16, 40
SMALL = {"lory": {"segment_len": 4}}  # several segments in T tokens


def _layer(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = {**resolve_recipe(name), **SMALL.get(name, {}), **overrides}
    settings = {"num_tokens": T, "vocab_size": V}
    return build_moe_layer(spec, in_features=D, hidden_features=H, model_settings=settings)


def _run(layer, x, ids, training: bool, dtype: torch.dtype | None = None):
    layer.train(training)
    torch.manual_seed(1)
    kwargs = {"token_ids": ids} if layer.registry_name == "hash" else {}
    if dtype is None:
        return layer(x, **kwargs), dict(layer.aux_losses)
    with torch.autocast("cpu", dtype=dtype):
        return layer(x, **kwargs), dict(layer.aux_losses)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# bf16 rounds to 2^-9 relative, fp16 to 2^-12: the layers' outputs stay within a few roundings of float32's
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_under_autocast(name, training, dtype):
    """Under autocast a layer returns the autocast dtype (as timm's ``Mlp``), its output stays within the dtype's
    rounding of the float32 layer's, its aux losses are float32 and equal the float32 layer's (the routers run in
    float32), and its gradients are finite and float32."""
    x = torch.randn(B, T, D)
    ids = torch.randint(0, V, (B, T))
    ref, ref_aux = _run(_layer(name), x, ids, training)
    layer = _layer(name)
    x_in = x.clone().requires_grad_()
    out, aux = _run(layer, x_in, ids, training, dtype)
    assert out.dtype == dtype
    assert _rel(out, ref) < TOLERANCE[dtype]
    assert aux.keys() == ref_aux.keys()
    for key, value in aux.items():
        assert value.dtype == torch.float32, key
        torch.testing.assert_close(value, ref_aux[key], rtol=1e-5, atol=1e-7)
    (out.float().square().sum() + sum(aux.values(), torch.zeros(()))).backward()
    grads = [x_in.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_cast_to_low_precision(name, training, dtype):
    """A layer cast to bf16 / fp16 (no autocast) runs on inputs of that dtype and returns it, within the dtype's
    rounding of the float32 layer with the same (rounded) weights; its losses are float32 and its gradients finite."""
    layer = _layer(name).to(dtype)
    ref_layer = _layer(name)
    ref_layer.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in layer.state_dict().items()})
    x = torch.randn(B, T, D).to(dtype)
    ids = torch.randint(0, V, (B, T))
    ref, ref_aux = _run(ref_layer, x.float(), ids, training)
    x_in = x.clone().requires_grad_()
    out, aux = _run(layer, x_in, ids, training)
    assert out.dtype == dtype
    assert _rel(out, ref) < TOLERANCE[dtype]
    assert aux.keys() == ref_aux.keys()
    for key, value in aux.items():
        assert value.dtype == torch.float32, key
    (out.float().square().sum() + sum(aux.values(), torch.zeros(()))).backward()
    assert x_in.grad.dtype == dtype and torch.isfinite(x_in.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", RECIPES)
def test_float64_layers_compute_in_float64(name):
    """A float64 layer (``64-true``) computes in float64 throughout, routing included: gradcheck of the output
    against its input and every parameter (evaluation: a fixed routing; router_init zeros would tie every logit)."""
    layer = _layer(name, **({"router_init": "default"} if name in ("noisy_top_k", "hierarchical") else {}))
    layer = layer.double().eval()
    x = torch.randn(1, 8, D, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (1, 8))
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
    kwargs = {"token_ids": ids} if name == "hash" else {}

    def forward(x, *params):
        out = functional_call(layer, dict(zip(names, params)), (x,), kwargs)
        assert out.dtype == torch.float64
        return out

    assert torch.autograd.gradcheck(forward, (x, *params), eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)


def _balancing_layer(**settings) -> TopKMoE:
    torch.manual_seed(0)
    return TopKMoE(8, 16, num_experts=2, top_k=1, **settings)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_balancing_state_stays_float32_in_a_low_precision_layer(dtype):
    """Loss-free balancing in a layer cast to bf16 / fp16: the token counts stay exact (bf16 holds no odd integer
    above 256: 1001 tokens over 2 experts always give one) and the biases keep moving by the rate (in bf16 0.5 +
    0.001 rounds back to 0.5: the biases froze there)."""
    layer = _balancing_layer(bias_update_rate=0.001, switch_loss_weight=0.01, switch_loss_scope="global_batch")
    layer = layer.to(dtype).train()
    router = layer.router
    for name in ("expert_bias", "pending_counts", "switch_fraction"):
        assert getattr(router, name).dtype == torch.float32, name
    router.expert_bias.fill_(0.5)
    x = torch.randn(1, 1001, 8).to(dtype)
    routing = router(x.reshape(-1, 8))
    counts = torch.bincount(routing.expert_ids.reshape(-1), minlength=2).float()
    assert torch.equal(router.pending_counts, counts)
    update_balancing_biases(layer)
    expected = 0.5 + 0.001 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(router.expert_bias, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(router.switch_fraction, counts / 1001)
    layer(x).float().sum().backward()  # and the layer still runs


def test_float64_cast_keeps_float64_state():
    """``.double()`` still casts that state to float64 (at least float32, never below); a layer built on the meta
    device and materialised in bf16 gets float32 state too."""
    layer = _balancing_layer(bias_update_rate=0.001).double()
    assert layer.router.expert_bias.dtype == torch.float64
    meta = TopKMoE(8, 16, num_experts=2, top_k=1, bias_update_rate=0.001, device="meta")
    meta = meta.to_empty(device="cpu").to(torch.bfloat16)
    assert meta.router.expert_bias.dtype == torch.float32 and meta.router.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("layer_cls", [TopKMoE, DenseMoE])
def test_gate_mass_totals_stay_float32_in_a_bf16_layer(layer_cls):
    """Eigen et al.'s running gate-mass totals in a bf16 layer: float32, so that a forward's mass still adds to a
    total of many forwards (in bf16 a total of 64 takes no addition below 0.25)."""
    torch.manual_seed(0)
    settings = {"num_experts": 4, "overpower_margin": 100.0}
    if layer_cls is TopKMoE:
        settings.update(top_k=2, normalize_gates=True)  # the kept gates of a token sum to 1
    layer = layer_cls(8, 16, **settings).to(torch.bfloat16).train()
    totals = (layer.router if layer_cls is TopKMoE else layer).overpowering.gate_mass_total
    assert totals.dtype == torch.float32
    totals.fill_(64.0)
    layer(torch.randn(2, 8, 8, dtype=torch.bfloat16))
    assert totals.sum().item() == pytest.approx(4 * 64.0 + 1.0, abs=1e-4)  # each forward adds 1 in all


def test_lory_state_follows_the_layer_precision():
    """Lory's segment sums and merging weights: float32 for a bf16 model (the decoding cache's ``like`` is a bf16
    weight), float64 in a float64 layer (they were float32, so a float64 layer routed in float32)."""
    layer = LoryMoE(8, 16, num_experts=4, segment_len=2)
    state = layer.init_state(2, torch.empty(1, dtype=torch.bfloat16))
    assert state.sum_BD.dtype == state.weights_BE.dtype == state.count_B.dtype == torch.float32
    layer = layer.double()
    state = layer.init_state(2, torch.empty(1, dtype=torch.float64))
    assert state.sum_BD.dtype == state.weights_BE.dtype == torch.float64
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    layer(x, state=state)
    assert state.weights_BE.dtype == torch.float64


def test_dense_moe_two_layer_gate_in_float64():
    """The two-layer gating network's biases stay float64 in a float64 layer (they were rounded to float32)."""
    torch.manual_seed(0)
    layer = DenseMoE(6, 8, num_experts=3, gate_hidden=5).double()
    with torch.no_grad():
        layer.gate_hidden_bias.normal_()
        layer.router_bias.normal_()
    x = torch.randn(1, 4, 6, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
    assert torch.autograd.gradcheck(
        lambda x, *ps: functional_call(layer, dict(zip(names, ps)), (x,)),
        (x, *params),
        eps=1e-6,
        atol=1e-5,
        rtol=1e-4,
        fast_mode=True,
    )


def test_state_is_float32_when_built_under_a_bf16_default_dtype():
    """Built under ``torch.set_default_dtype(torch.bfloat16)`` (Fabric's and Lightning's ``init_module`` for
    ``bf16-true``), the parameters are bf16 and the balancing state float32."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = TopKMoE(8, 16, num_experts=2, top_k=1, bias_update_rate=0.001, overpower_margin=1.0)
    finally:
        torch.set_default_dtype(default)
    router = layer.router
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.pending_counts.dtype == torch.float32
    assert router.overpowering.gate_mass_total.dtype == torch.float32
