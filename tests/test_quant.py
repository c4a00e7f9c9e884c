"""Quantized experts (moekit.quant): the grids' bounds, bit packing, the Tunstall code of ternary weights,
GPTQ against the paper's loop and against round-to-nearest, quantized banks and checkpoints."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
from torch import nn

import moekit.models  # noqa: F401  (registers the models with timm)
from conftest import reference_gptq
from moekit.moe import ExpertBank
from moekit.moe.experts import experts_on_meta
from moekit.quant import (
    FORMATS,
    CalibrationError,
    QuantFormat,
    QuantizedExpertBank,
    QuantizedWeight,
    QuantSpec,
    expert_banks,
    expert_memory,
    gptq_quantize,
    quantize_experts,
    quantized_banks,
    rtn_quantize,
)
from moekit.quant.formats import fit_quantizer, pack_codes, unpack_codes
from moekit.quant.ternary_code import CHUNK, build_code, chunk_ends, chunk_lengths, decode, encode, entropy_bits


# ---------------------------------------------------------------------------------------------
# Grids
@pytest.mark.parametrize("name", FORMATS)
def test_rounding_error_is_at_most_half_a_step_inside_the_grid(name):
    fmt = QuantFormat(name, group_size=16)
    w = torch.randn(3, 40, 24) * torch.rand(1, 40, 1)  # rows of different scales, a short last group
    q = rtn_quantize(w, fmt)
    g = fmt.group_rows(40)
    scale = q.scale.float().repeat_interleave(g, dim=1)[:, :40]
    if fmt.symmetric:  # {-s, 0, s}
        lo, hi = -scale, scale
    else:
        zero = q.zero.float().repeat_interleave(g, dim=1)[:, :40]
        lo, hi = -zero * scale, (fmt.levels - 1 - zero) * scale
    inside = (w >= lo - scale / 2) & (w <= hi + scale / 2)
    assert float(inside.float().mean()) > 0.9
    err = (w - q.dequantize()).abs()
    assert bool((err[inside] <= scale[inside] / 2 * (1 + 1e-3) + 1e-7).all())


@pytest.mark.parametrize(("name", "gain"), [("int4", 0.95), ("int2", 0.8), ("ternary", 0.8)])
def test_the_clipping_search_never_does_worse_than_the_full_range(name, gain, monkeypatch):
    fmt = QuantFormat(name, group_size=128)
    w = torch.randn(4, 128, 24)  # at 2 bits the best grid of a Gaussian group spans well inside its extremes
    searched = fit_quantizer(fmt, w, dim=1)
    monkeypatch.setattr("moekit.quant.formats.CLIP_FACTORS", [1.0])
    full = fit_quantizer(fmt, w, dim=1)
    err_searched = (searched.round(w) - w).pow(2).sum(1)
    err_full = (full.round(w) - w).pow(2).sum(1)
    assert bool((err_searched <= err_full * (1 + 1e-6)).all())
    assert float(err_searched.sum()) < gain * float(err_full.sum())


def test_int8_error_is_at_most_one_step_everywhere():
    w = torch.randn(4, 64, 16)
    q = rtn_quantize(w, QuantFormat("int8", 32))
    scale = q.scale.float().repeat_interleave(32, dim=1)
    err = (w - q.dequantize()).abs()
    assert bool((err <= scale).all()), "half a step, and half a step of the integer zero point at the ends"
    assert float(err.max()) < 0.01 * float(w.abs().max())
    groups = w.view(4, 2, 32, 16)  # 255 steps over each group's range (zero included): 8 bits, not fewer
    span = groups.amax(2).clamp_min(0) - groups.amin(2).clamp_max(0)
    assert bool((q.scale.float() <= span / 255 * 1.01).all())  # the scale is stored in 16 bits


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_pack_then_unpack_gives_the_codes_back(bits, rows):
    codes = torch.randint(0, 2**bits, (3, rows, 5), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, math.ceil(rows * bits / 8), 5)
    torch.testing.assert_close(unpack_codes(packed, bits, rows), codes, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The Tunstall code
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("zeros", [0.34, 0.9])
@pytest.mark.parametrize("stream_len", [CHUNK, 3 * CHUNK + 123, 100])
def test_tunstall_code_round_trips(bits, zeros, stream_len):
    probs = torch.tensor([(1 - zeros) / 2, zeros, (1 - zeros) / 2])
    symbols = torch.multinomial(probs, 3 * stream_len, replacement=True).to(torch.uint8).view(3, stream_len)
    code = build_code(torch.bincount(symbols.flatten().long(), minlength=3), bits)
    codewords, offsets = encode(symbols, code)
    lengths = chunk_lengths(stream_len)
    ends = chunk_ends(codewords, offsets, lengths.repeat(3), code)
    per = lengths.numel()
    for s in range(3):
        lo, hi = int(offsets[s * per]), int(offsets[(s + 1) * per])
        last = offsets[s * per + 1 : (s + 1) * per + 1] - 1 - lo
        decoded = decode(codewords[lo:hi], last, ends[s * per : (s + 1) * per], code.table, code.lengths)
        torch.testing.assert_close(decoded, symbols[s], rtol=0, atol=0)


@pytest.mark.parametrize("bits", [8, 16])
def test_tunstall_dictionary_is_complete_and_prefix_free_with_2_to_the_bits_words(bits):
    code = build_code((100, 800, 100), bits)
    assert code.lengths.numel() <= 2**bits and code.lengths.numel() > 2**bits - 3
    words = {tuple(row[:n].tolist()) for row, n in zip(code.table, code.lengths.tolist())}
    assert len(words) == code.lengths.numel()
    assert not any(w[:k] in words for w in words for k in range(1, len(w))), "a word is a prefix of another"
    # complete: the words' probabilities (add-one smoothed) sum to 1, so every sequence parses
    p = [(c + 1) / 1003 for c in (100, 800, 100)]
    assert sum(math.prod(p[s] for s in w) for w in words) == pytest.approx(1.0, abs=1e-9)


def test_tunstall_code_comes_close_to_the_entropy_of_sparse_ternary_weights():
    probs = torch.tensor([0.05, 0.9, 0.05])
    symbols = torch.multinomial(probs, 64 * CHUNK, replacement=True).to(torch.uint8).view(8, -1)
    counts = torch.bincount(symbols.flatten().long(), minlength=3)
    h = entropy_bits(counts)
    for bits, slack in ((8, 1.2), (16, 1.08)):
        codewords, _ = encode(symbols, build_code(counts, bits))
        rate = codewords.numel() * bits / symbols.numel()
        assert h <= rate <= slack * h, (bits, rate, h)
    assert h < 0.6  # two bits per weight packed would be 3.4x larger


# ---------------------------------------------------------------------------------------------
# GPTQ
def _correlated_inputs(n: int, d: int) -> torch.Tensor:
    """Inputs on a low-dimensional subspace with a few large features, as activations are."""
    x = torch.randn(n, 6) @ torch.randn(6, d) + 0.05 * torch.randn(n, d)
    return x * (1 + 4 * (torch.arange(d) % 7 == 0))


@pytest.mark.parametrize(
    ("name", "group_size", "block_size"),
    [(name, 16, 32) for name in FORMATS] + [("int4", 24, 16), ("int2", 12, 8)],  # groups starting inside a block
)
def test_batched_gptq_equals_the_papers_one_row_at_a_time_loop(name, group_size, block_size):
    fmt = QuantFormat(name, group_size=group_size)
    w = torch.randn(3, 64, 10)
    x = [_correlated_inputs(200, 64) for _ in range(3)]
    hessian = torch.stack([xe.t() @ xe for xe in x]).double()
    hessian[1, 5, :] = hessian[1, :, 5] = 0  # an input no token sets
    q = gptq_quantize(w, hessian, fmt, block_size=block_size)
    for e in range(3):
        expected = reference_gptq(w[e], hessian[e], fmt)
        torch.testing.assert_close(q.codes[e], expected, rtol=0, atol=0)
    assert bool((q.dequantize()[1, 5] == 0).all()), "an input no token sets gets weight zero"


@pytest.mark.parametrize("name", ["int4", "int2", "ternary"])
def test_gptq_reconstructs_a_layers_outputs_better_than_round_to_nearest(name):
    fmt = QuantFormat(name, group_size=32)
    w = torch.randn(2, 64, 48)
    x = _correlated_inputs(512, 64)
    hessian = (x.t() @ x).expand(2, 64, 64)

    def output_error(q) -> float:
        return float((x @ (w - q.dequantize())).pow(2).sum())

    rtn, gptq = output_error(rtn_quantize(w, fmt)), output_error(gptq_quantize(w, hessian, fmt))
    assert gptq < 0.5 * rtn, (gptq, rtn)


def test_gptq_with_an_identity_hessian_rounds_to_nearest():
    fmt = QuantFormat("int4", group_size=16)
    w = torch.randn(2, 48, 8)
    q = gptq_quantize(w, torch.eye(48).expand(2, 48, 48), fmt)
    torch.testing.assert_close(q.codes, rtn_quantize(w, fmt).codes, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Quantized banks
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("gated", [False, True])
def test_quantized_bank_computes_the_float_bank_with_the_dequantized_weights(name, gated):
    bank = ExpertBank(4, 16, 24, act_layer=nn.SiLU if gated else nn.GELU, gated=gated).eval()
    fmt = QuantFormat(name, group_size=8)
    q1, q2 = rtn_quantize(bank.fc1_weight.detach(), fmt), rtn_quantize(bank.fc2_weight.detach(), fmt)
    biases = {"fc1_bias": bank.fc1_bias.detach(), "fc2_bias": bank.fc2_bias.detach()}
    quantized = QuantizedExpertBank(bank, QuantizedWeight.from_codes(q1), QuantizedWeight.from_codes(q2), biases)
    with torch.no_grad():
        bank.fc1_weight.copy_(q1.dequantize())
        bank.fc2_weight.copy_(q2.dequantize())
    x = torch.randn(20, 16)
    for sizes in (5, torch.tensor([7, 0, 9, 2])):  # equal groups, ragged with an empty expert and dropped rows
        torch.testing.assert_close(quantized(x, sizes), bank(x, sizes), rtol=1e-5, atol=1e-5)


def test_quantize_experts_replaces_every_bank_and_stores_fewer_bytes():
    model = timm.create_model("top2_moe_vit_tiny_patch4_28", num_classes=10).eval()
    x = torch.randn(8, 1, 28, 28)
    before = expert_memory(model)
    float_out = model(x)
    quantize_experts(model, QuantSpec(QuantFormat("int8"), "rtn"))
    assert not expert_banks(model) and len(quantized_banks(model)) > 0
    after = expert_memory(model)
    assert after.weights == before.weights
    assert before.bits_per_weight == 32 and 8 < after.bits_per_weight < 8.25  # scales and zeros: 24 bits per 128
    # int8 moves the logits by ~3e-4 (zeroed or swapped experts: ~5e-2)
    torch.testing.assert_close(model(x), float_out, rtol=0, atol=2e-3)


def test_gptq_calibration_uses_the_tokens_routed_to_each_expert_and_falls_back_when_too_few():
    model = timm.create_model("top2_moe_vit_tiny_patch4_28", num_classes=10).eval()
    inputs = [torch.randn(2, 1, 28, 28)]  # 2 images x 49 tokens x top-2: ~25 rows per expert of 8
    with pytest.raises(CalibrationError, match="fewer than the"):
        quantize_experts(copy.deepcopy(model), QuantSpec(QuantFormat("int4"), "gptq"), lambda: inputs)
    first = next(m for m in model.modules() if isinstance(m, ExpertBank))
    seen = []
    hook = first.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    with torch.no_grad():
        model(inputs[0])
    hook.remove()
    counts = seen[0]  # the first bank's rows per expert (later banks see the rounded weights before them)
    assert int(counts.sum()) == 2 * 49 * 2, "dropless at evaluation: every token's two choices"
    reports = quantize_experts(model, QuantSpec(QuantFormat("int4"), "gptq", min_rows=20), lambda: inputs)
    assert (reports[0].rows_min, reports[0].rows_max) == (int(counts.min()), int(counts.max()))
    for report in reports:  # experts under 20 rows round to nearest, in fc1 and fc2 alike
        assert bool(report.rtn_fallback) == (report.rows_min < 20)
        assert len(set(report.rtn_fallback.values())) <= 1
    assert any(report.rtn_fallback for report in reports), "some expert got too few rows here"


def test_a_dense_model_has_nothing_to_quantize():
    with pytest.raises(ValueError, match="dense model"):
        quantize_experts(timm.create_model("vit_tiny_patch4_28"), QuantSpec(QuantFormat("int8"), "rtn"))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_a_model_that_merges_its_experts_is_refused_before_any_work(method):
    """Lory merges its experts' weights for every token: rtn left a model that failed in its forward (no `merged`),
    gptq blamed the calibration data."""
    from moekit.models import TransformerLM

    lm = TransformerLM(
        vocab_size=32, max_seq_len=8, dim=16, depth=1, num_heads=2, moe=dict(recipe="lory", segment_len=4)
    )
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"blocks.0.mlp \(LoryMoE\): a layer that merges the weights of all its experts"
    ):
        quantize_experts(lm, QuantSpec(QuantFormat("int4"), method), lambda: [torch.randint(32, (2, 8))])
    assert all(torch.equal(v, before[k]) for k, v in lm.state_dict().items()), "the model is left as it was"


def test_experts_built_on_meta_take_no_memory():
    with experts_on_meta():
        bank = ExpertBank(64, 256, 1024)
    assert bank.fc1_weight.is_meta and bank.fc2_weight.is_meta
    assert not ExpertBank(2, 4, 8).fc1_weight.is_meta


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints
@pytest.mark.parametrize("name", ["int4", "ternary"])
def test_a_quantized_checkpoint_reloads_bit_exactly(name, tmp_path):
    from conftest import TINY_NET
    from moekit.checkpoint import load_task
    from moekit.quant import quant_metadata
    from moekit.quantized_checkpoint import save_quantized_task
    from moekit.tasks import ImageClassifier

    task = ImageClassifier(net=TINY_NET, num_classes=10).eval()
    spec = QuantSpec(QuantFormat(name, group_size=16), "gptq", min_rows=1)
    quantize_experts(task.net, spec, lambda: [torch.randn(4, 1, 28, 28)])
    path = save_quantized_task(task, quant_metadata(spec, task.net), tmp_path / "q.safetensors")
    loaded = load_task(str(path))
    saved, reloaded = task.net.state_dict(), loaded.net.state_dict()
    assert saved.keys() == reloaded.keys()
    for key in saved:
        assert saved[key].dtype == reloaded[key].dtype and torch.equal(saved[key], reloaded[key]), key
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(loaded.net(x), task.net(x))
    assert loaded.quantization["format"] == name and len(quantized_banks(loaded.net)) == 1
