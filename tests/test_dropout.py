"""moekit.moe.dropout: the CPU mask of 16-bit levels drops each element with probability p (to 1/65536), every lane of
a 64-bit draw alike, keeps the expectation, and backpropagates through the same mask; models use it throughout, and
the CPU attention (moekit.models.attention.attention_with_dropout) applies it to the probabilities."""

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

import moekit.models  # noqa: F401  (registers the ViTs)
import moekit.models.attention as attention_module
from moekit.models import LSTMMoELM, TransformerLM
from moekit.models.attention import attention_with_dropout
from moekit.moe.dropout import CHUNK_DRAWS, LEVELS, Dropout, _levels, dropout, use_fast_dropout


def _exact_keep(p: float) -> float:
    return 1 - round(p * LEVELS) / LEVELS


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_each_lane_of_a_draw_keeps_an_element_with_probability_one_minus_p(p):
    torch.manual_seed(0)
    n = 1 << 22
    kept = dropout(torch.ones(n), p) != 0  # [n]
    keep = _exact_keep(p)
    sigma = math.sqrt(keep * (1 - keep) / (n // 4))
    for lane in range(4):  # element i comes from 16 bits (lane i % 4) of draw i // 4: the sign bit's lane included
        assert abs(kept[lane::4].double().mean().item() - keep) < 5 * sigma, lane
    # neighbours are independent: P(both kept) = keep^2
    both = (kept[:-1] & kept[1:]).double().mean().item()
    assert abs(both - keep**2) < 10 * math.sqrt(keep**2 * (1 - keep**2) / n)  # overlapping pairs: a wider bound


@pytest.mark.parametrize("p", [0.1, 0.25, 0.9])
def test_kept_elements_scale_by_one_over_the_exact_keep_probability(p):
    torch.manual_seed(1)
    x = torch.randn(1000, 37)
    y = dropout(x, p)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / _exact_keep(p), rtol=1e-6, atol=0)
    assert round(0.1 * LEVELS) / LEVELS == pytest.approx(0.1, abs=1 / LEVELS)
    # the expectation is the input: E[y] = x, checked on a constant input over many elements
    ones = dropout(torch.ones(1 << 20), p)
    assert ones.double().mean().item() == pytest.approx(1.0, abs=5 * math.sqrt(p / (1 - p) / (1 << 20)))


def test_gradient_flows_through_the_same_mask():
    torch.manual_seed(2)
    x = torch.randn(64, 96, requires_grad=True)
    g = torch.randn(64, 96)
    y = dropout(x, 0.3)
    y.backward(g)
    noise = (y / x).detach()  # 0 or 1 / keep
    torch.testing.assert_close(x.grad, g * noise)
    scaled = torch.isclose(noise, torch.tensor(1 / _exact_keep(0.3)))
    assert ((noise == 0) | scaled).all() and scaled.any() and (noise == 0).any()


def test_odd_sizes_strided_inputs_inplace_and_bfloat16():
    torch.manual_seed(3)
    x = torch.randn(7, 5, 3).transpose(0, 2)  # 105 elements, not a multiple of 4, not contiguous
    y = dropout(x, 0.5)
    assert y.shape == x.shape and ((y == 0) | torch.isclose(y, 2 * x)).all()
    assert 0.3 < (y == 0).float().mean() < 0.7, "about half of the 105 dropped"  # binomial: 0.5 +- 0.05 std
    z = torch.randn(33)
    out = dropout(z, 0.5, inplace=True)
    assert out is z and ((z == 0).any() and (z != 0).any())
    b = dropout(torch.ones(4096, dtype=torch.bfloat16), 0.5)
    assert b.dtype == torch.bfloat16 and set(b.unique().tolist()) == {0.0, 2.0}
    assert abs((b == 0).float().mean().item() - 0.5) < 0.04  # 0.5 +- 0.008 std


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_noise_is_the_scale_where_kept_and_zero_elsewhere_in_every_float_dtype(dtype):
    from moekit.moe.dropout import _noise

    level = torch.randint(-(2**15), 2**15, (1001,), generator=torch.Generator().manual_seed(0), dtype=torch.int16)
    for lowest_kept in (-32000, -26214, 0, 32000):
        keep = level >= lowest_kept
        assert 0 < keep.sum() < level.numel()
        for scale in (1 / 0.9, 65536 / 65535, 2.0, 10.0):
            got = _noise(level, lowest_kept, scale, dtype)
            assert got.dtype == dtype
            assert torch.equal(got, torch.where(keep, torch.tensor(scale, dtype=dtype), 0.0)), (lowest_kept, scale)


def test_the_mask_follows_the_seed_and_advances_the_generator():
    x = torch.randn(4096)
    torch.manual_seed(4)
    a, b = dropout(x, 0.2), dropout(x, 0.2)
    torch.manual_seed(4)
    assert torch.equal(dropout(x, 0.2), a)
    assert not torch.equal(a, b)


def test_a_large_mask_comes_from_generators_the_default_one_seeds_whatever_the_thread_count():
    """Beyond ``CHUNK_DRAWS`` 64-bit draws a mask comes in chunks of that many, each drawn by a generator seeded with
    one draw of the default generator, the chunks over the CPU's threads: the same mask on one thread as on two, and
    the default generator moved on by one draw per chunk."""
    x = torch.empty(4 * CHUNK_DRAWS * 3 + 5)  # 3 whole chunks and a piece: 4 seeds
    threads, masks, following = torch.get_num_threads(), {}, {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(3)
            masks[n] = _levels(x)
            following[n] = torch.empty(1, dtype=torch.int64).random_(-(2**63), None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[1], masks[2]) and torch.equal(following[1], following[2])
    torch.manual_seed(3)
    seeds = torch.empty(5, dtype=torch.int64).random_(-(2**63), None)
    assert following[2].item() == seeds[4].item(), "4 seeds drawn, then the caller's next draw"
    for i, seed in enumerate(seeds[:4].tolist()):
        size = min(CHUNK_DRAWS, (x.numel() + 3) // 4 - i * CHUNK_DRAWS)
        chunk = torch.empty(size, dtype=torch.int64).random_(
            -(2**63), None, generator=torch.Generator().manual_seed(seed)
        )
        first = i * 4 * CHUNK_DRAWS
        assert torch.equal(masks[2][first : first + 4 * size], chunk.view(torch.int16)[: x.numel() - first]), i


def test_identity_in_eval_or_without_dropout_and_torch_at_the_ends():
    x = torch.randn(10)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros(10))  # 65536 levels dropped: torch's F.dropout
    # 65535 levels: a keep scale of 65536, past float16's largest value (65504): torch's F.dropout, whose 1 / (1 - p)
    # float16 holds, keeps every kept element finite
    half = torch.ones(1 << 20, dtype=torch.float16)
    torch.manual_seed(0)
    kept = dropout(half, 0.99998)
    kept = kept[kept != 0]
    assert kept.numel() > 0 and torch.equal(kept, torch.full_like(kept, 1 / (1 - 0.99998)))  # finite, 49984 in float16
    layer = Dropout(0.5).eval()
    assert layer(x) is x


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_dropout_draws_the_eager_masks_without_a_graph_break(backend):
    """Two dropouts of one shape in one graph: neither merged (torch 2.11 merged them when the draws took only their
    size) nor redrawn for the backward."""

    def f(x):
        return dropout(torch.tanh(x), 0.3) + dropout(x, 0.3) ** 2

    x = torch.randn(1 << 10, 3, requires_grad=True)
    g = torch.randn(1 << 10, 3)
    torch.manual_seed(5)
    eager = f(x)
    eager.backward(g)
    eager_grad, x.grad = x.grad, None
    torch.manual_seed(5)
    compiled = torch.compile(f, backend=backend, fullgraph=True)(x)
    compiled.backward(g)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, eager_grad, rtol=1e-6, atol=1e-6)


def test_use_fast_dropout_replaces_torch_s_dropout_and_keeps_the_state_dict():
    mlp = Mlp(8, 16, drop=0.25)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    assert use_fast_dropout(mlp) is mlp
    assert type(mlp.drop1) is Dropout and mlp.drop1.p == 0.25 and type(mlp.drop2) is Dropout
    assert mlp.state_dict().keys() == before.keys()
    torch.manual_seed(6)
    x = torch.randn(4, 8)
    torch.testing.assert_close(
        mlp.eval()(x), F.linear(F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)), mlp.fc2.weight, mlp.fc2.bias)
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda: TransformerLM(vocab_size=50, max_seq_len=16, dim=32, depth=2, num_heads=4, dropout=0.1, moe="mixtral"),
        lambda: TransformerLM(vocab_size=50, max_seq_len=16, dim=32, depth=2, num_heads=4, dropout=0.1, moe="none"),
        lambda: LSTMMoELM(vocab_size=50, dim=32, dropout=0.1),
        lambda: timm.create_model("vit_tiny_patch4_28", moe="switch", proj_drop_rate=0.1, drop_rate=0.1),
    ],
    ids=["moe_lm", "dense_lm", "lstm_lm", "vit"],
)
def test_models_use_it_for_every_dropout(build):
    drops = [m for m in build().modules() if isinstance(m, nn.Dropout)]
    assert drops and all(type(m) is Dropout for m in drops)
    assert any(m.p == pytest.approx(0.1) for m in drops)


def _attention_inputs(heads=4, kv_heads=4, tokens=12, batch=3, hd=8, dtype=torch.float32):
    torch.manual_seed(7)
    q = torch.randn(batch, heads, tokens, hd, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, tokens, hd, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, tokens, hd, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_with_dropout_is_sdpa_without_it(kv_heads, masked, dtype):
    """p = 0: the same values and gradients as F.scaled_dot_product_attention (causal or a key mask, grouped heads),
    in float64 to float64's precision."""
    q, k, v = _attention_inputs(kv_heads=kv_heads, dtype=dtype)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    mask = causal
    if masked:  # a batch-dependent key mask that keeps each query's own key: [batch, 1, tokens, keys]
        keys = torch.rand(3, 12) > 0.4
        mask = (causal & (keys.unsqueeze(1) | torch.eye(12, dtype=torch.bool))).unsqueeze(1)
    g = torch.randn(3, 4, 12, 8, dtype=dtype)
    ours = attention_with_dropout(q, k, v, mask, 0.0)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 4)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(ours, ref, **tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)


def test_attention_with_dropout_in_bf16_has_the_float32_softmax_s_probabilities():
    """bf16 (p = 0): the softmax runs in bf16, whose CPU kernel sums in float32 and rounds once: the output is the
    float32 softmax's probabilities cast to bf16, bit for bit, and the gradients are float64's to bf16's precision."""
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _attention_inputs(tokens=32))
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    ours = attention_with_dropout(q, k, v, causal, 0.0)
    bias = torch.zeros(32, 32, dtype=torch.bfloat16).masked_fill_(~causal, float("-inf"))
    flat = [t.detach().reshape(-1, 32, 8) for t in (q, k, v)]
    scores = torch.baddbmm(bias.expand(12, 32, 32), flat[0], flat[1].transpose(1, 2), alpha=8**-0.5)
    want = torch.bmm(torch.softmax(scores.float(), dim=-1).to(torch.bfloat16), flat[2]).view(3, 4, 32, 8)
    assert torch.equal(ours.detach(), want)
    g = torch.randn(3, 4, 32, 8)
    grads = torch.autograd.grad(ours, (q, k, v), g.to(torch.bfloat16))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=causal)
    for got, want in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        torch.testing.assert_close(got.double(), want, rtol=2**-5, atol=2**-5)


def test_attention_with_dropout_drops_probabilities_with_the_seeded_mask():
    q, k, v = _attention_inputs(tokens=16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    torch.manual_seed(8)
    out = attention_with_dropout(q, k, v, causal, 0.25)
    torch.manual_seed(8)
    noise = dropout(torch.ones(3 * 4, 16, 16), 0.25).view(3, 4, 16, 16)  # the same draws, on ones
    probs = torch.softmax(
        (q @ k.transpose(-1, -2)) / math.sqrt(8) + torch.zeros(16, 16).masked_fill(~causal, -math.inf), -1
    )
    torch.testing.assert_close(out, (probs * noise) @ v)
    assert (noise == 0).any()


def test_the_lm_attention_takes_it_in_cpu_training_only(monkeypatch):
    lm = TransformerLM(vocab_size=50, max_seq_len=16, dim=32, depth=1, num_heads=4, dropout=0.2, moe="none")
    ids = torch.randint(0, 50, (2, 16))
    calls = []

    def spy(*args):
        calls.append(args[-1])
        return attention_with_dropout(*args)

    monkeypatch.setattr(attention_module, "attention_with_dropout", spy)
    lm.train()(ids)
    lm.eval()(ids)
    assert calls == [0.2]
