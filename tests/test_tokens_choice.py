"""Tokens-choice top-k (Switch, GShard, Mixtral, noisy top-k, DeepSeekMoE), capacity and BPR."""

import pytest
import torch
from timm.layers import Mlp, SwiGLU
from torch import nn

from conftest import reference_tokens_choice
from moekit.moe import TopKMoE, kernel_choices, update_balancing_biases
from moekit.moe import dispatch as dispatch_module
from moekit.moe.capacity import tokens_choice_capacity
from moekit.moe.dispatch import _GatherRows, _stable_sort, combine, dispatch, plan_dispatch, priority_order
from moekit.moe.losses import cv_squared, vmoe_load_loss


def _routing_and_plan(layer, x):
    routing = layer.router(x.reshape(-1, x.shape[-1]), None)
    return routing, layer.plan(routing, x.shape[0], x.shape[1])


def test_plan_dispatch_hand_computed_capacity_choice_major():
    expert_ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    plan = plan_dispatch(expert_ids, num_experts=3, capacity=2)
    # first choices fill buffers first (t0, t1 -> expert 0; t3 -> expert 1), then second choices
    expected_keep = torch.tensor([[True, True], [True, True], [False, False], [True, False]])
    assert torch.equal(plan.keep, expected_keep)
    assert plan.counts.tolist() == [2, 2, 1]
    kept_sorted = torch.sort(torch.where(plan.keep, expert_ids, 3).reshape(-1)).values
    assert torch.equal(torch.where(plan.keep, expert_ids, 3).reshape(-1)[plan.order], kept_sorted)


def test_a_plan_says_when_its_groups_cover_every_dispatched_row():
    """``all_kept`` (the experts may skip zeroing a tail) only where nothing can be dropped."""
    expert_ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    dropless = plan_dispatch(expert_ids, 3)
    assert dropless.all_kept and int(dropless.counts.sum()) == expert_ids.numel()
    assert not plan_dispatch(expert_ids, 3, capacity=8).all_kept  # nothing dropped here, but it could be
    assert not plan_dispatch(expert_ids, 3, keep=torch.ones(4, 2, dtype=torch.bool)).all_kept
    assert not plan_dispatch(expert_ids, 3, valid=torch.tensor([True, True, True, False])).all_kept


@pytest.mark.parametrize(
    "top_k, width, dtype",
    [
        (3, 8, torch.float64),
        (2, 8, torch.float64),
        (2, 64, torch.float32),
        (2, 256, torch.bfloat16),
        (2, 256, torch.float64),
        (3, 200, torch.float64),
    ],
    ids=["multiply-sum", "pair", "pair-float32", "pair-bf16", "bmm", "bmm-k3"],
)
def test_combine_sums_the_kept_gated_outputs_of_each_token(top_k, width, dtype, monkeypatch):
    """Every CPU path (a batched matmul for large float32 / float64 products, else for top-2 one product and one
    fused multiply-add, else a multiply and a sum) gives ``sum_j keep * gate * out`` per token, in values and gradients;
    a dropped assignment contributes nothing."""
    calls, pairs = [], []
    bmm, pair = torch.bmm, dispatch_module._CombinePair.apply
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(a) or bmm(*a))
    monkeypatch.setattr(dispatch_module._CombinePair, "apply", lambda *a: pairs.append(a) or pair(*a))
    expert_ids = torch.randint(0, 4, (10, top_k))
    plan = plan_dispatch(expert_ids, 4, capacity=4)  # 30 assignments into 16 slots: some dropped
    assert not plan.keep.all()
    expert_out = torch.randn(10 * top_k, width, dtype=torch.float64).to(dtype).requires_grad_()
    gates = torch.rand(10, top_k, dtype=torch.float64).to(dtype).requires_grad_()
    grad = torch.randn(10, width, dtype=torch.float64).to(dtype)
    combine(expert_out, plan, gates).backward(grad)
    assert bool(calls) == (dtype != torch.bfloat16 and top_k * width >= 400), "the path of the dtype and size"
    assert bool(pairs) == (top_k == 2 and not calls)
    got = (expert_out.grad, gates.grad)
    expert_out = expert_out.detach().double().requires_grad_()
    gates, grad = gates.detach().double().requires_grad_(), grad.double()
    row_of = torch.empty_like(plan.order).scatter_(0, plan.order, torch.arange(plan.order.numel()))  # assignment's row
    expected = torch.zeros(10, width, dtype=torch.float64)
    for n in range(10):
        for j in range(top_k):
            if plan.keep[n, j]:
                expected[n] += gates[n, j] * expert_out[row_of[n * top_k + j]]
    expected.backward(grad)
    torch.testing.assert_close(combine(expert_out, plan, gates), expected.detach())
    for g, r in zip(got, (expert_out.grad, gates.grad)):
        torch.testing.assert_close(g.double(), r, **({} if dtype == torch.float64 else {"rtol": 0.02, "atol": 0.05}))


def test_the_pair_combine_hands_back_its_rows_gradient_in_their_layout():
    """The gates of a choice-major plan are column-major ``[N, 2]``; the top-2 combine's gradient of its ``[N, 2, o]``
    rows still comes back laid out as they are (a strided one cost a copy of it on its way back to the rows)."""
    plan = plan_dispatch(torch.randint(0, 4, (64, 2)), 4, capacity=24)
    weights = torch.where(plan.keep, torch.rand(64, 2), 0.0).requires_grad_()
    assert weights.stride() == (1, 64)
    rows = torch.randn(128, 8, requires_grad=True)
    strides = []
    a_N2O = rows.view(64, 2, 8)
    a_N2O.register_hook(lambda grad: strides.append(grad.stride()))
    dispatch_module._CombinePair.apply(a_N2O, weights).sum().backward()
    assert strides == [(16, 8, 1)]


@pytest.mark.parametrize("kernel", ["cpu", "gather"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dispatch_copies_each_token_k_times_and_sums_its_copies_gradients(top_k, kernel):
    """Row ``r`` of the dispatch is token ``order[r] // k``; a token's gradient is the sum of its ``k`` rows', with
    assignments dropped by capacity among them: on CPUs by ``index_select``'s backward, elsewhere by a gather of
    each token's rows (``_GatherRows``, run here on the CPU)."""
    expert_ids = torch.randint(0, 4, (10, top_k))
    plan = plan_dispatch(expert_ids, 4, capacity=3)
    assert torch.equal(plan.inverse[plan.order], torch.arange(10 * top_k))  # the inverse permutation
    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(10 * top_k, 6, dtype=torch.float64)
    tokens = torch.div(plan.order, top_k, rounding_mode="floor")
    rows = dispatch(x, plan) if kernel == "cpu" else _GatherRows.apply(x, tokens, plan.inverse, top_k)
    rows.backward(grad)
    expected_grad = torch.zeros(10, 6, dtype=torch.float64)
    for r, a in enumerate(plan.order.tolist()):
        torch.testing.assert_close(rows[r], x[a // top_k], rtol=0, atol=0)
        expected_grad[a // top_k] += grad[r]
    torch.testing.assert_close(x.grad, expected_grad)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm absent")
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "dropping"])
def test_the_grouped_mm_kernel_gives_the_loops_layer(capacity_factor):
    """A top-2 layer with the device-side kernel (dropless: no tail masks; dropping: a masked tail) gives the
    outputs and gradients of the same layer with the per-expert loop."""
    results = []
    for kernel in ("loop", "grouped_mm"):
        torch.manual_seed(0)
        layer = TopKMoE(16, 32, num_experts=4, top_k=2, capacity_factor=capacity_factor)
        layer.experts.kernel = kernel
        x = torch.randn(2, 24, 16, requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        results.append((out, x.grad, layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad))
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kw", [dict(top_k=2, capacity_factor=0.5), dict(top_k=1, capacity_factor=0.75, gated=True)], ids=["top2", "top1"]
)
def test_a_layer_that_drops_runs_its_experts_on_the_kept_rows_alone(kw, dtype, monkeypatch):
    """On a CPU the experts of a layer that drops assignments see only the kept rows (``kept_rows``), with the
    outputs and gradients, bit for bit, of the experts run on every dispatched row (the dropped ones as zeros)."""
    rows_seen, results = [], []
    for trim in (True, False):
        if not trim:
            monkeypatch.setattr(dispatch_module, "kept_rows", lambda plan: None)
        torch.manual_seed(0)
        layer = TopKMoE(16, 32, num_experts=4, **kw)
        layer.experts.register_forward_pre_hook(lambda bank, args: rows_seen.append((args[0].shape[0], args[1])))
        x = torch.randn(2, 24, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = layer(x)
        out.float().square().sum().backward()
        results.append((out, x.grad, *(p.grad for p in layer.parameters())))
    (kept, counts), (every, _) = rows_seen
    assert kept == int(counts.sum()) < every == 48 * kw["top_k"]
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_priority_order_is_highest_score_first_ties_by_index():
    assert priority_order(torch.tensor([0.1, 0.9, 0.3, 0.9, 0.2])).tolist() == [1, 3, 2, 4, 0]


@pytest.mark.parametrize("num", [5000, 12288, 20000, 32768, 40000])
def test_cpu_sorts_through_the_radix_path_give_torch_sorts_order(num):
    """Expert ids and BPR priorities from ``kernel_choices.SORT_RADIX_FROM`` entries on sort as int32 keys padded to
    the radix sort's length (priorities through their bits): the order of ``torch.sort(..., stable=True)``, ties by
    index, with negative, zero of both signs, subnormal, infinite and NaN priorities (of either sign bit: torch's
    sort puts every NaN first)."""
    generator = torch.Generator().manual_seed(num)
    for bound in (9, 257, 2**20):
        keys = torch.randint(0, bound, (num,), generator=generator)
        values, indices = _stable_sort(keys, bound)
        expected = torch.sort(keys, stable=True)
        assert torch.equal(values.long(), expected.values) and torch.equal(indices, expected.indices)
    priority = torch.randn(num, generator=generator)
    priority[::5] = priority[1]  # ties
    priority[::11], priority[::13] = 0.0, -0.0
    priority[:4] = torch.tensor([float("inf"), -float("inf"), 1e-40, -1e-40])
    nans = priority.clone()
    nans[4:8] = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -0x7FFFFF], dtype=torch.int32).view(torch.float32)
    scores = torch.softmax(torch.randn(num, 8, generator=generator), -1).amax(-1)
    for p in (priority, priority.abs(), scores, nans):
        assert torch.equal(priority_order(p), torch.sort(p, descending=True, stable=True).indices)


def test_a_large_plan_is_the_plan_of_torchs_comparison_sort(monkeypatch):
    """A capacity-bound BPR plan of 12,800 tokens top-2 (its sorts on the radix path) keeps and orders exactly what
    the same plan does with every sort left to torch's comparison sort."""
    expert_ids = torch.rand(12800, 8).topk(2, dim=-1).indices
    priority = torch.rand(12800)
    plans = []
    for radix_from in (kernel_choices.SORT_RADIX_FROM, 10**12):
        monkeypatch.setattr(kernel_choices, "SORT_RADIX_FROM", radix_from)
        plans.append(plan_dispatch(expert_ids, 8, capacity=3000, priority=priority))
    assert not plans[0].keep.all()
    for name in ("order", "counts", "keep", "inverse"):
        assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), name


def test_batch_prioritized_routing_drops_lowest_priority_first():
    expert_ids = torch.zeros(6, 1, dtype=torch.long)  # everyone wants expert 0, capacity 2
    priority = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.2, 0.5])
    fifo = plan_dispatch(expert_ids, 2, capacity=2)
    bpr = plan_dispatch(expert_ids, 2, capacity=2, priority=priority)
    assert fifo.keep[:, 0].tolist() == [True, True, False, False, False, False]
    assert bpr.keep[:, 0].tolist() == [False, True, False, True, False, False]


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=1),  # Switch
        dict(top_k=2, normalize_gates=True),  # Mixtral
        dict(top_k=2, capacity_factor=0.5),  # drops
        dict(top_k=2, capacity_factor=0.5, batch_priority=True),
        dict(top_k=3, score_func="sigmoid", normalize_gates=True, num_shared_experts=2),
        dict(top_k=2, gated=True, act_layer=nn.SiLU, bias=False),
    ],
)
def test_forward_equals_per_token_reference(kw):
    layer = TopKMoE(8, 16, num_experts=5, **kw).eval()
    x = torch.randn(2, 7, 8)
    routing, plan = _routing_and_plan(layer, x)
    if "capacity_factor" in kw:  # the drops, queued one assignment at a time (first choices before second ones)
        scores = torch.softmax(x.reshape(14, 8) @ layer.router.weight.t(), -1)
        order = sorted(range(14), key=lambda n: -scores[n].max().item()) if kw.get("batch_priority") else range(14)
        capacity = tokens_choice_capacity(14, kw["top_k"], 5, kw["capacity_factor"])
        keep, taken = torch.zeros_like(plan.keep), [0] * 5
        for j in range(kw["top_k"]):
            for n in order:
                e = int(routing.expert_ids[n, j])
                keep[n, j], taken[e] = taken[e] < capacity, taken[e] + 1
        assert torch.equal(plan.keep, keep) and not keep.all()
    ref = reference_tokens_choice(layer, x, routing.expert_ids, routing.gates, plan.keep)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-6)


def test_each_token_reaches_at_most_k_distinct_experts_and_capacity_holds():
    layer = TopKMoE(8, 16, num_experts=6, top_k=3, capacity_factor=0.7).train()
    x = torch.randn(4, 25, 8)
    routing, plan = _routing_and_plan(layer, x)
    assert routing.expert_ids.shape == (100, 3)
    assert all(len(set(row)) == 3 for row in routing.expert_ids.tolist())
    capacity = tokens_choice_capacity(100, 3, 6, 0.7)
    kept_per_expert = torch.bincount(routing.expert_ids[plan.keep], minlength=6)
    assert torch.equal(kept_per_expert, plan.counts)
    assert int(plan.counts.max()) <= capacity
    layer(x)
    assert 0 < layer.stats["dropped_fraction"] < 1


def test_overflow_tokens_come_out_unchanged_through_the_residual():
    layer = TopKMoE(8, 16, num_experts=2, top_k=1, capacity_factor=0.5).eval()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0  # every token with x[0] > 0 strongly prefers expert 0
    x = torch.randn(1, 8, 8)
    x[..., 0] = torch.linspace(1, 2, 8)
    out = layer(x)
    routing, plan = _routing_and_plan(layer, x)
    dropped = ~plan.keep[:, 0]
    assert dropped.sum() == 6  # capacity ceil(8 * 0.5 / 2) = 2 for expert 0
    assert torch.all(out[0][dropped] == 0), "a dropped token adds nothing: x + moe(x) == x"
    assert torch.all(out[0][~dropped].abs().sum(-1) > 0)


def test_switch_gate_is_the_top1_probability():
    layer = TopKMoE(8, 16, num_experts=4, top_k=1)
    x = torch.randn(10, 8)
    routing = layer.router(x, None)
    probs = torch.softmax(x @ layer.router.weight.t(), dim=-1)
    torch.testing.assert_close(routing.gates[:, 0], probs.max(dim=-1).values)
    assert torch.equal(routing.expert_ids[:, 0], probs.argmax(dim=-1))


def test_normalized_top2_gates_sum_to_one():
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, normalize_gates=True)
    routing = layer.router(torch.randn(10, 8), None)
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(10))


@pytest.mark.parametrize("gated", [False, True])
def test_upcycled_moe_equals_the_dense_mlp(gated):
    dense = SwiGLU(8, 16, bias=True) if gated else Mlp(8, 16)
    layer = TopKMoE(
        8, 16, num_experts=4, top_k=2, normalize_gates=True, gated=gated, act_layer=nn.SiLU if gated else nn.GELU
    )
    layer.experts.load_dense_mlp(dense)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-6)


def test_gradients_reach_router_and_experts_gradcheck():
    layer = TopKMoE(4, 6, num_experts=3, top_k=2, normalize_gates=True, num_shared_experts=1).double()
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer(x), (x,))
    layer(x).pow(2).sum().backward()
    for name in ("router.weight", "experts.fc1_weight", "experts.fc2_bias", "shared_experts.fc1_weight"):
        grad = layer.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_router_runs_in_float32_under_bf16_autocast():
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, z_loss_weight=1e-3)
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = layer.router(x.reshape(-1, 8).bfloat16(), None)
        out = layer(x)
    assert routing.gates.dtype == routing.probs.dtype == torch.float32
    assert layer.aux_losses["z"].dtype == torch.float32
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "dropping"])
def test_the_dispatch_copies_tokens_in_the_compute_dtype(capacity_factor):
    """Under bf16 autocast the tokens are cast before the dispatch copies them: the experts receive bf16 rows (half the
    bytes of float32 copies); values and the input's gradient stay those of the float32 layer, to bf16's precision."""
    torch.manual_seed(0)
    layer = TopKMoE(16, 32, num_experts=4, top_k=2, capacity_factor=capacity_factor)
    seen = []
    layer.experts.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    x = torch.randn(2, 24, 16, requires_grad=True)
    weight = torch.randn(2, 24, 16)
    (layer(x) * weight).sum().backward()
    out32, grad32 = layer(x).detach(), x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    (out.float() * weight).sum().backward()
    assert seen == [torch.float32, torch.float32, torch.bfloat16]
    torch.testing.assert_close(out.float(), out32, rtol=0.03, atol=0.03)
    torch.testing.assert_close(x.grad, grad32, rtol=0.03, atol=0.03)


def test_noisy_gating_noise_in_training_only_and_losses():
    layer = TopKMoE(8, 16, num_experts=6, top_k=2, noisy_gating=True, importance_loss_weight=0.1, load_loss_weight=0.1)
    assert torch.all(layer.router.noise_weight == 0), "W_noise starts at zero (Shazeer et al.)"
    x = torch.randn(2, 20, 8)
    layer.eval()
    a, b = layer.router(x.reshape(-1, 8), None), layer.router(x.reshape(-1, 8), None)
    assert torch.equal(a.expert_ids, b.expert_ids)
    assert set(a.aux_losses) == {"importance"}, "the load loss is defined through the training noise"
    layer.train()
    a, b = layer.router(x.reshape(-1, 8), None), layer.router(x.reshape(-1, 8), None)
    assert not torch.equal(a.expert_ids, b.expert_ids)
    assert set(a.aux_losses) == {"importance", "load"}
    layer(x)
    sum(layer.aux_losses.values()).backward()
    assert layer.router.noise_weight.grad.abs().sum() > 0, "the load loss trains W_noise"


def test_vmoe_router_fixed_noise_and_losses_follow_vmoe():
    """V-MoE: noise of std noise_std / E on the logits in training only, choice and gates from the noisy softmax,
    importance over the clean softmax of all experts, load by V-MoE's estimator (the vmoe recipe)."""
    layer = TopKMoE(
        8,
        16,
        num_experts=4,
        top_k=2,
        noise_std=1.0,
        importance_over="probs",
        importance_loss_weight=1.0,
        load_loss_weight=1.0,
        capacity_factor=1.05,
    )
    x = torch.randn(64, 8)
    clean = x @ layer.router.weight.t()
    layer.eval()
    routing = layer.router(x, None)
    torch.testing.assert_close(routing.gates, torch.softmax(clean, -1).topk(2).values)
    assert set(routing.aux_losses) == {"importance"}, "the load loss needs the training noise"
    torch.testing.assert_close(routing.aux_losses["importance"], cv_squared(torch.softmax(clean, -1).sum(0)))
    layer.train()
    torch.manual_seed(3)
    routing = layer.router(x, None)
    torch.manual_seed(3)
    noisy = clean + torch.randn_like(clean) * (1.0 / 4)
    torch.testing.assert_close(routing.gates, torch.softmax(noisy, -1).topk(2).values)
    torch.testing.assert_close(routing.aux_losses["importance"], cv_squared(torch.softmax(clean, -1).sum(0)))
    expected_load = vmoe_load_loss(clean, noisy, torch.full_like(clean, 0.25), 2)
    torch.testing.assert_close(routing.aux_losses["load"], expected_load)


def test_shazeer_importance_is_over_the_sparse_gates():
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, normalize_gates=True, importance_loss_weight=1.0).eval()
    x = torch.randn(32, 8)
    routing = layer.router(x, None)
    sparse = torch.zeros(32, 4).scatter(1, routing.expert_ids, routing.gates)
    torch.testing.assert_close(routing.aux_losses["importance"], cv_squared(sparse.sum(0)))


def test_loss_free_balancing_bias_steers_selection_not_gates():
    layer = TopKMoE(8, 16, num_experts=4, top_k=1, bias_update_rate=0.1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0  # expert 0 gets every token with x[0] > 0
    x = torch.randn(1, 40, 8).abs()
    layer.train()
    layer(x)
    counts = layer.router.pending_counts.clone()
    assert counts.sum() == 40 and counts[0] == 40
    update_balancing_biases(layer)
    # mean load 10: expert 0 (40) goes down by the rate, the others (0) go up by it
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert torch.all(layer.router.pending_counts == 0)
    routing = layer.router(x.reshape(-1, 8), None)
    probs = torch.softmax(x.reshape(-1, 8) @ layer.router.weight.t(), -1)
    torch.testing.assert_close(routing.gates[:, 0], probs.gather(1, routing.expert_ids)[:, 0])
    layer.router.pending_counts.zero_()
    layer.eval()
    layer(x)
    assert torch.all(layer.router.pending_counts == 0), "only training forwards count"


def test_loss_free_balancing_evens_out_the_load():
    layer = TopKMoE(8, 16, num_experts=4, top_k=1, bias_update_rate=0.002).train()
    with torch.no_grad():
        layer.router.weight.mul_(0.1)
        layer.router.weight[0] += 1.0  # expert 0 is far more popular
    x = torch.randn(4, 64, 8)
    layer(x)
    before = layer.stats["load_cv"].item()
    loads = []
    for _ in range(300):
        layer(x)
        update_balancing_biases(layer)
        loads.append(layer.stats["expert_load"])
    average = torch.stack(loads[-50:]).mean(0)  # sign updates hover around balance
    assert before > 0.5
    assert average.std(unbiased=False) / average.mean() < 0.1


def test_capacity_at_eval():
    layer = TopKMoE(8, 16, num_experts=4, top_k=1, capacity_factor=0.5, eval_capacity_factor=None)
    assert layer.train().expert_capacity(16) == 2 and layer.eval().expert_capacity(16) is None
    same = TopKMoE(8, 16, num_experts=4, top_k=1, capacity_factor=0.5)
    assert same.eval().expert_capacity(16) == 2


def test_shared_experts_add_a_dense_mlp_of_the_expert_size():
    layer = TopKMoE(8, 4, num_experts=8, top_k=2, num_shared_experts=2)
    assert layer.experts.hidden_features == 4
    assert layer.shared_experts.num_experts == 1 and layer.shared_experts.hidden_features == 8


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(top_k=5), "top_k=5"),
        (dict(top_k=0), "top_k=0"),
        (dict(capacity_factor=0.0), "capacity_factor=0.0"),
        (dict(capacity_factor=-1), "capacity_factor=-1"),
        (dict(eval_capacity_factor=0), "eval_capacity_factor=0"),
        (dict(load_loss_weight=0.1), r"needs noise on the logits \(noisy_gating=True or noise_std > 0\)"),
        (dict(noisy_gating=True, noise_std=1.0), "both set; choose one"),
        (dict(importance_over="tokens"), "importance_over='tokens'; allowed: 'gates', 'probs'"),
        (dict(expert_hidden_features=4), r"unknown setting\(s\) \['expert_hidden_features'\]; allowed: \[.*'top_k'"),
        (dict(switch_loss_weight=-0.1), "switch_loss_weight"),
        (dict(score_func="relu"), "score_func"),
        (dict(num_shared_experts=-1), "num_shared_experts"),
        (dict(norm_layer=nn.LayerNorm), "norm_layer"),
        (dict(use_conv=True), "use_conv"),
    ],
)
def test_bad_arguments_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        TopKMoE(8, 16, num_experts=4, **kw)


def test_wrong_input_shape():
    with pytest.raises(ValueError, match=r"expected \[batch, tokens, 8\]"):
        TopKMoE(8, 16, num_experts=4)(torch.randn(3, 9))


def test_plan_dispatch_groups_apply_capacity_per_group():
    # 2 groups of 3 tokens, all choosing expert 0, capacity 1: the first token of each group is kept.
    expert_ids = torch.zeros(6, 1, dtype=torch.long)
    groups = torch.tensor([0, 1, 0, 1, 0, 1])
    plan = plan_dispatch(expert_ids, 2, capacity=1, group_ids=groups, num_groups=2)
    assert plan.keep[:, 0].tolist() == [True, True, False, False, False, False]
    assert plan.counts.tolist() == [2, 0]


@pytest.mark.parametrize("batch_priority", [False, True])
def test_position_capacity_is_per_position_and_causal(batch_priority):
    torch.manual_seed(0)
    layer = TopKMoE(
        8, 16, num_experts=4, top_k=2, capacity_factor=0.5, capacity_scope="position", batch_priority=batch_priority
    ).train()
    assert layer.causal_safe
    x = torch.randn(6, 10, 8)
    routing, plan = _routing_and_plan(layer, x)
    capacity = tokens_choice_capacity(6, 2, 4, 0.5)  # over the 6 tokens at one position
    per_position = torch.zeros(10, 4, dtype=torch.long)
    positions = torch.arange(10).repeat(6).unsqueeze(1).expand(-1, 2)
    per_position.index_put_((positions[plan.keep], routing.expert_ids[plan.keep]), torch.tensor(1), accumulate=True)
    assert int(per_position.max()) <= capacity
    assert not plan.keep.all(), "the capacity binds in this setting"
    # Changing the tokens after position t leaves the outputs at positions <= t unchanged.
    out = layer(x)
    changed = x.clone()
    changed[:, 6:] = torch.randn(6, 4, 8)
    torch.testing.assert_close(layer(changed)[:, :6], out[:, :6])
    # ... and so does a forward of the prefix alone (what incremental decoding sees).
    torch.testing.assert_close(layer(x[:, :6]), out[:, :6])
