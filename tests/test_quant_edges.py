"""Quantized experts at their edges: padded calibration text, bfloat16 serving, small scales, the Tunstall code's
choice for a whole matrix, GPTQ's device and settings out of range, a failed quantization, the benchmark's metric."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from moekit.moe import ExpertBank
from moekit.quant import (
    CalibrationError,
    QuantFormat,
    QuantizedExpertBank,
    QuantizedWeight,
    QuantSpec,
    gptq_quantize,
    quantize_experts,
    quantized_banks,
    rtn_quantize,
)
from moekit.quant.formats import CLIP_FACTORS, _grid, fit_quantizer


class _Batches:
    """A datamodule whose training split is the given batches."""

    def __init__(self, batches):
        self.batches = batches

    def prepare_data(self):
        pass

    def setup(self, stage):
        pass

    def train_dataloader(self):
        return self.batches


def _tiny_lm():
    from moekit.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab_size=32, max_seq_len=16, dim=16, depth=2, num_heads=2).eval()  # top-2 of 8 experts


def test_gptq_calibration_leaves_out_the_padding_of_unpacked_text():
    """Text with ``pack=false`` pads each document's window and its batches carry a padding mask: the padding must
    not reach GPTQ's Hessians (it was routed to experts as token 0 and counted in their rows)."""
    from moekit.commands.quantize import calibration_inputs
    from moekit.data.text import PAD_TARGET

    lm = _tiny_lm()
    real = 10
    tokens = torch.randint(1, 32, (4, 16))
    mask = (torch.arange(16) < real).expand(4, 16)
    padded = tokens.masked_fill(~mask, 0)
    targets = tokens.roll(-1, 1).masked_fill(~mask, PAD_TARGET)
    inputs = calibration_inputs(_Batches([(padded, targets, mask)]), 1)
    spec = QuantSpec(QuantFormat("int4", group_size=8), "gptq", min_rows=1)
    with_padding, truncated = copy.deepcopy(lm), copy.deepcopy(lm)
    reports = quantize_experts(with_padding, spec, lambda: inputs)
    expected = quantize_experts(truncated, spec, lambda: [tokens[:, :real]])  # the real tokens alone (causal)
    assert [(r.rows_min, r.rows_max) for r in reports] == [(r.rows_min, r.rows_max) for r in expected]
    saved, reference = with_padding.state_dict(), truncated.state_dict()
    for key in reference:
        assert torch.equal(saved[key], reference[key]), key


def test_calibration_inputs_of_images_stay_tensors():
    from moekit.commands.quantize import calibration_inputs

    images = torch.randn(2, 1, 28, 28)
    inputs = calibration_inputs(_Batches([(images, torch.tensor([1, 2]))] * 3), 2)
    assert len(inputs) == 2 and all(x is images for x in inputs)


def _quantized_bank(name: str = "int4"):
    torch.manual_seed(0)
    bank = ExpertBank(3, 16, 24, act_layer=nn.GELU).eval()
    fmt = QuantFormat(name, group_size=8)
    q1, q2 = rtn_quantize(bank.fc1_weight.detach(), fmt), rtn_quantize(bank.fc2_weight.detach(), fmt)
    biases = {"fc1_bias": bank.fc1_bias.detach(), "fc2_bias": bank.fc2_bias.detach()}
    quantized = QuantizedExpertBank(bank, QuantizedWeight.from_codes(q1), QuantizedWeight.from_codes(q2), biases)
    return bank, quantized, q1, q2


@pytest.mark.parametrize("name", ["int4", "ternary"])
def test_bfloat16_experts_are_the_dequantized_weights_rounded_once(name):
    """The weights a bfloat16 forward uses are the float weights the codes stand for, rounded to bfloat16 once
    (what calibration copied into the float bank); rounding the float16 scales to bfloat16 first moved them."""
    bank, quantized, q1, q2 = _quantized_bank(name)
    for weight, q in ((quantized.fc1, q1), (quantized.fc2, q2)):
        for e in range(3):
            torch.testing.assert_close(
                weight.dequantize(e, torch.bfloat16), q.dequantize()[e].bfloat16(), rtol=0, atol=0
            )
    with torch.no_grad():
        bank.fc1_weight.copy_(q1.dequantize())
        bank.fc2_weight.copy_(q2.dequantize())
    x = torch.randn(9, 16).bfloat16()
    torch.testing.assert_close(quantized(x, 3), bank.bfloat16()(x, 3), rtol=2e-2, atol=2e-2)


def test_a_bfloat16_model_keeps_the_float16_scales_it_was_quantized_with():
    """``trainer.precision=bf16-true`` converts the model with ``module.to(torch.bfloat16)``: the scales are a part of
    the codes, not a float weight, and stay float16 (as bfloat16 they lost 3 bits and moved every weight)."""
    _, quantized, q1, _ = _quantized_bank("int4")
    scale = quantized.fc1.scale.clone()
    quantized.to(torch.bfloat16)
    assert quantized.fc1_bias.dtype == torch.bfloat16, "the float parts follow the model"
    assert quantized.fc1.scale.dtype == torch.float16 and torch.equal(quantized.fc1.scale, scale)
    torch.testing.assert_close(
        quantized.fc1.dequantize(1, torch.bfloat16), q1.dequantize()[1].bfloat16(), rtol=0, atol=0
    )
    quantized.double()
    assert quantized.fc1.scale.dtype == torch.float16 and quantized.fc1_bias.dtype == torch.float64


def test_the_tunstall_code_is_chosen_for_the_whole_matrix(monkeypatch):
    """One decoding table serves all the experts of a matrix, so the 8- or 16-bit choice weighs it against all their
    codewords (it was weighed against one expert's, which undercounts the 16-bit code's savings E times)."""
    import moekit.quant.bank as bank_module

    seen = []
    choose = bank_module.choose_code
    monkeypatch.setattr(bank_module, "choose_code", lambda counts, n: seen.append(n) or choose(counts, n))
    _, quantized, q1, q2 = _quantized_bank("ternary")
    assert seen == [q1.codes.numel(), q2.codes.numel()] == [3 * 16 * 24, 3 * 24 * 16]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_rows": 0}, "min_rows=0"),
        ({"min_rows": -3}, "min_rows=-3"),
        ({"min_rows": "many"}, "min_rows='many'"),
        ({"min_rows": 2.5}, "min_rows=2.5"),
        ({"block_size": 0}, "block_size=0"),
    ],
)
def test_gptq_settings_out_of_range_are_refused_naming_the_value(settings, message):
    """``min_rows=0`` ran GPTQ with an all-zero Hessian for an expert calibration never reached, and zeroed all its
    weights (every input 'dead'); block_size=0 died in range()."""
    with pytest.raises(ValueError, match=message):
        QuantSpec(QuantFormat("int4"), "gptq", **settings)


def test_an_expert_that_calibration_never_reaches_keeps_its_weights():
    """The default min_rows rounds an unreached expert to nearest: its weights are not zeroed."""
    lm = _tiny_lm()
    calibration = [torch.randint(32, (1, 2))]  # 2 tokens x top-2: at most 4 of the 8 experts of a layer
    quantize_experts(lm, QuantSpec(QuantFormat("int8"), "gptq", min_rows=1), lambda: calibration)
    for _, bank in quantized_banks(lm):
        for e in range(bank.num_experts):
            assert bool(bank.fc1.dequantize(e).abs().sum() > 0), e


@pytest.mark.parametrize("name", ["int4", "ternary"])
def test_gptq_returns_its_codes_on_the_device_of_the_weights(name, monkeypatch):
    """The codes were always made on the CPU: GPTQ on CUDA weights copied them column by column to the host and
    returned codes on the CPU with scales on the GPU. The meta device stands in for a GPU here (it has no values
    for the positive-definiteness check to read)."""
    factor = torch.linalg.cholesky
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda h: (factor(h), torch.zeros(h.shape[0], dtype=torch.int32)))
    w = torch.randn(2, 16, 4, device="meta")
    q = gptq_quantize(w, torch.randn(2, 16, 16, device="meta"), QuantFormat(name, group_size=8))
    assert {t.device.type for t in (q.codes, q.scale, q.zero) if t is not None} == {"meta"}


def test_the_benchmarks_perplexity_leaves_out_padding():
    """bench_quant's perplexity averaged over every position, padding included (its targets are ignored by the
    cross-entropy but were counted), and ran unpacked text without its padding mask."""
    import math

    import torch.nn.functional as F

    from moekit.analysis.bench_quant import _test_metric
    from moekit.data.text import PAD_TARGET

    lm = _tiny_lm()
    tokens = torch.randint(1, 32, (2, 16))
    mask = (torch.arange(16) < 10).expand(2, 16)
    targets = tokens.roll(-1, 1).masked_fill(~mask, PAD_TARGET)
    with torch.no_grad():
        logits = lm(tokens)
    expected = math.exp(float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD_TARGET)))
    ppl, _, _ = _test_metric(lm, [(tokens, targets)], True, None)
    assert ppl == pytest.approx(expected, rel=1e-5)
    inputs = {"input_ids": tokens.masked_fill(~mask, 0), "padding_mask": mask}
    ppl_masked, error, _ = _test_metric(lm, [(inputs, targets)], True, [logits])
    assert ppl_masked == pytest.approx(expected, rel=1e-4)


def test_quantize_refuses_a_bad_min_rows_before_loading_the_checkpoint(tmp_path):
    from conftest import compose_config
    from moekit.commands.quantize import quantize

    with pytest.raises(ValueError, match=r"min_rows=0 must be a positive int or null"):  # the config check
        compose_config("quantize", [f"ckpt_path={tmp_path}/missing.ckpt", "min_rows=0"], tmp_path / "run")
    cfg = compose_config("quantize", [f"ckpt_path={tmp_path}/missing.ckpt"], tmp_path / "run")
    cfg.min_rows = 0  # a config built in Python, past the composition's check: refused before the checkpoint loads
    with pytest.raises(ValueError, match=r"min_rows=0 must be a positive int, or None \(null in the config"):
        quantize(cfg)


def test_gptq_without_damping_on_a_rank_deficient_hessian_names_damping():
    """damping=0 is allowed, but inputs spanning fewer dimensions than the matrix has (a LayerNorm's output at
    initialisation, or fewer rows than inputs) left a bare torch.linalg error."""
    x = torch.randn(5, 16)  # 5 rows: rank 5 of 16
    hessian = torch.stack([x.t() @ x, torch.eye(16)])
    with pytest.raises(ValueError, match=r"with damping=0.0 the Hessian of expert\(s\) \[0\] .* raise damping"):
        gptq_quantize(torch.randn(2, 16, 4), hessian, QuantFormat("int4", group_size=8), damping=0.0)
    gptq_quantize(torch.randn(2, 16, 4), hessian, QuantFormat("int4", group_size=8))  # GPTQ's 1% damping


@pytest.mark.parametrize("flag", ["--group-size", "--calibration-batches"])
def test_the_benchmark_refuses_a_bad_setting_before_loading(flag, tmp_path, capsys):
    """A group size of 0 failed after loading the checkpoint and its data, 0 calibration batches with a message
    about the training split's length."""
    from moekit.analysis import bench_quant

    with pytest.raises(SystemExit):
        bench_quant.main(["--ckpt", str(tmp_path / "missing.ckpt"), flag, "0"])
    assert f"{flag}=0 must be positive" in capsys.readouterr().err


class _TwoBanks(nn.Module):
    """Two expert banks one after the other, 4 experts of 8 rows each: enough rows for the first bank's 4 inputs,
    too few for the second's 32."""

    def __init__(self):
        super().__init__()
        self.first = ExpertBank(4, 4, 8, 32)
        self.second = ExpertBank(4, 32, 8, 4)

    def forward(self, x):
        return self.second(self.first(x, 8), 8)


class _OneBank(nn.Module):
    def __init__(self, bank):
        super().__init__()
        self.bank = copy.deepcopy(bank)

    def forward(self, x):
        return self.bank(x, 8)


def test_a_quantization_that_fails_leaves_the_network_as_it_was():
    """The first bank's weights were rounded in place before the second bank's calibration failed: the network was
    left half rounded (and in eval mode), and a retry with more calibration rounded them twice."""
    torch.manual_seed(0)
    net = _TwoBanks().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    inputs = [torch.randn(32, 4)]
    with pytest.raises(CalibrationError, match=r"second.fc1: .*fewer than the 32 GPTQ needs"):
        quantize_experts(net, QuantSpec(QuantFormat("int4", group_size=4), "gptq"), lambda: inputs)
    assert net.training and isinstance(net.first, ExpertBank) and isinstance(net.second, ExpertBank)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    quantize_experts(net, QuantSpec(QuantFormat("int4", group_size=4), "gptq", min_rows=8), lambda: inputs)
    assert [name for name, _ in quantized_banks(net)] == ["first", "second"] and net.training


def test_later_banks_calibrate_on_the_rounded_banks_before_them():
    """GPTQ's sequential order: the second bank's Hessians come from what the quantized first bank passes on."""
    torch.manual_seed(0)
    net = _TwoBanks().eval()
    inputs = [torch.randn(32, 4)]
    spec = QuantSpec(QuantFormat("int2", group_size=4), "gptq", min_rows=8)
    reference = copy.deepcopy(net)
    quantize_experts(net, spec, lambda: inputs)
    # by hand: the first bank alone, then the second calibrated on the first's rounded outputs
    first, second = _OneBank(reference.first), _OneBank(reference.second)
    quantize_experts(first, spec, lambda: inputs)
    with torch.no_grad():
        hidden = first(inputs[0])
    quantize_experts(second, spec, lambda: [hidden])
    for fc in ("fc1", "fc2"):
        assert torch.equal(getattr(net.second, fc).packed, getattr(second.bank, fc).packed), fc


@pytest.mark.parametrize(("std", "slack"), [(1e-3, 1.02), (1e-4, 1.05)])  # subnormal spacing: 2^-24
def test_int8_keeps_its_256_levels_on_small_weights(std, slack):
    """Scales were clamped to float16's smallest normal value (6.1e-5): int8 on weights of std 1e-3 got a grid
    3.8x too coarse and twice the rounding error of half a step; float16 subnormals hold such scales."""
    torch.manual_seed(0)
    w = torch.randn(4, 128, 16) * std
    q = rtn_quantize(w, QuantFormat("int8", group_size=128))
    span = w.amax(1, keepdim=True).clamp_min(0) - w.amin(1, keepdim=True).clamp_max(0)
    step = span / 255
    assert bool((q.scale.float() >= step).all()), "the grid spans the group"
    assert bool((q.scale.float() <= step * slack).all())
    assert bool(((q.dequantize() - w).abs() <= q.scale.float()).all())


def test_a_group_whose_full_range_overflows_float16_takes_a_clipped_scale_that_fits():
    """The clipping search's first factor (1.0) needs a ternary scale of 1e5, past float16's largest: infinite, NaN
    weights, a NaN error that no later factor could beat. Now the factors whose scale fits compete as usual, and the
    search keeps the one of smallest error among them."""
    w = torch.tensor([[1e5, -2e4, 3e4, 5e4]])
    fmt = QuantFormat("ternary", group_size=4)
    q = fit_quantizer(fmt, w)
    assert bool(torch.isfinite(q.scale).all()) and bool(torch.isfinite(q.round(w)).all())
    errors = [
        float((g.round(w) - w).pow(2).sum())
        for g in (_grid(fmt, -c * w.abs().max(), c * w.abs().max()) for c in CLIP_FACTORS)
    ]
    finite = [e for e in errors if math.isfinite(e)]
    assert finite and len(finite) < len(errors)  # some factors overflow, some fit
    assert float((q.round(w) - w).pow(2).sum()) == min(finite)


def test_calibration_leaves_a_callers_group_sizes_tensor_as_it_was():
    """A bank called with a fixed LongTensor of rows per expert (``ExpertBank``'s contract allows it): calibration over
    3 batches sums 3 x 6 rows per expert without adding into that tensor (it was doubled in place, then the next batch
    split 12 rows as [12, 12])."""

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.bank = ExpertBank(2, 4, 8, 4)
            self.sizes = torch.tensor([6, 6])

        def forward(self, x):
            return self.bank(x, self.sizes)

    torch.manual_seed(0)
    net = Fixed().eval()
    batches = [torch.randn(12, 4) for _ in range(3)]
    reports = quantize_experts(net, QuantSpec(QuantFormat("int4", 4), "gptq", min_rows=4), lambda: batches)
    assert net.sizes.tolist() == [6, 6]
    assert {(r.rows_min, r.rows_max) for r in reports} == {(18, 18)}


@pytest.mark.parametrize(("name", "largest_ok"), [("ternary", 6e4), ("int4", 4.5e5)])
def test_weights_past_the_float16_scales_are_refused_naming_the_bank(name, largest_ok):
    """A ternary group with |w| up to 1e5 (int4: a range of 2e6) got an infinite float16 scale and NaN weights,
    silently; the largest weights a float16 scale holds still quantize finitely."""
    torch.manual_seed(0)
    net = _TwoBanks().eval()
    with torch.no_grad():
        net.second.fc1_weight.mul_(largest_ok / net.second.fc1_weight.abs().max())
    fine = copy.deepcopy(net)
    quantize_experts(fine, QuantSpec(QuantFormat(name, group_size=4), "rtn"))
    assert all(bool(torch.isfinite(t).all()) for t in fine.state_dict().values() if t.is_floating_point())
    with torch.no_grad():
        net.second.fc1_weight.mul_(10)
    with pytest.raises(ValueError, match=r"second.fc1: weights up to \|w\| = .* need scales past float16's largest"):
        quantize_experts(net, QuantSpec(QuantFormat(name, group_size=4), "rtn"))
    assert isinstance(net.second, ExpertBank) and isinstance(net.first, ExpertBank)  # left as it was
