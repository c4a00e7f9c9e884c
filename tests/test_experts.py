"""Expert bank: every kernel equals the per-expert reference, in values and gradients."""

import importlib

import pytest
import torch
from timm.layers import GluMlp, Mlp, SwiGLU
from torch import nn

from conftest import reference_expert
from moekit.models.flops import flop_counter
from moekit.moe import ExpertBank, grouped_linear, kernel_choices
from moekit.moe.grouped_linear import _resolve_kernel, _row_blocks
from moekit.moe.grouped_mm import HAS_GROUPED_MM
from moekit.moe.kernel_choices import PLANES_MIN_ROWS, ROW_BLOCK

grouped_linear_module = importlib.import_module("moekit.moe.grouped_linear")  # the package's name is the function

KERNELS = ["loop", "bmm"] + (["grouped_mm"] if HAS_GROUPED_MM else [])


def _reference_grouped(x, weight, bias, counts):
    out = torch.zeros(x.shape[0], weight.shape[-1], dtype=x.dtype)
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        out[rows] = x[rows] @ weight[e] + (bias[e] if bias is not None else 0)
        start += n
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_linear_equal_groups_matches_reference(kernel, with_bias):
    x = torch.randn(4 * 5, 8, requires_grad=True)
    w = torch.randn(4, 8, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True) if with_bias else None
    grad = torch.randn(20, 4)
    out = grouped_linear(x, w, b, 5, kernel)
    out.backward(grad)
    got = [x.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if with_bias else [])
    for t in [x, w] + ([b] if with_bias else []):
        t.grad = None
    ref = _reference_grouped(x, w, b, [5] * 4)
    ref.backward(grad)
    want = [x.grad, w.grad] + ([b.grad] if with_bias else [])
    torch.testing.assert_close(out, ref)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "bmm"])
def test_grouped_linear_ragged_with_empty_experts_and_tail(kernel):
    counts = torch.tensor([3, 0, 5, 1])  # expert 1 empty; 2 tail rows belong to no expert
    x = torch.randn(11, 4, requires_grad=True)
    w = torch.randn(4, 4, 8, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    grad = torch.randn(11, 8)
    out = grouped_linear(x, w, b, counts, kernel)
    assert torch.all(out[9:] == 0), "rows past the last group must be zeros"
    out.backward(grad)
    got = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None
    ref = torch.cat([_reference_grouped(x[:9], w, b, counts.tolist()), torch.zeros(2, 8)])
    ref.backward(grad)
    torch.testing.assert_close(out, ref)
    for g, r in zip(got, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(g, r)
    assert torch.all(got[1][1] == 0) and torch.all(got[2][1] == 0), "the empty expert gets zero gradient"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["equal", "ragged", "ragged_no_tail"])
def test_grouped_linear_takes_the_stride_0_gradient_of_a_sum(kernel, layout):
    """``out.sum().backward()`` sends an expanded (stride-0) gradient; every kernel gives the reference's, with a
    bias, also told that the groups cover every row (``no_tail``: no masks in between)."""
    equal = layout == "equal"
    if kernel == "bmm" and not equal:
        pytest.skip("bmm takes equal groups only")
    sizes = [4, 4, 4] if equal else [5, 0, 7]
    x = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    group_sizes = 4 if equal else torch.tensor(sizes)
    grouped_linear(x, w, b, group_sizes, kernel, no_tail=layout == "ragged_no_tail").sum().backward()
    got = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None
    _reference_grouped(x, w, b, sizes).sum().backward()
    for g, r in zip(got, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(g, r)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm absent")
def test_the_grouped_mm_kernels_gradients_add_nothing_atomically():
    """The accelerators' kernel sums each expert's bias gradient with a grouped product, not with ``index_add_``
    (atomic adds on GPUs: another order, other low bits, in every run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func._schema.name)
            return func(*args, **(kwargs or {}))

    x = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    with Ops():
        grouped_linear(x, w, b, torch.tensor([5, 0, 6]), "grouped_mm").square().sum().backward()
    assert "aten::_grouped_mm" in seen and b.grad is not None
    assert not seen & {"aten::index_add", "aten::index_add_", "aten::scatter_add", "aten::scatter_add_"}


def test_loop_kernel_gradcheck_float64():
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: grouped_linear(x, w, b, counts, "loop"), (x, w, b))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows_each", [3, PLANES_MIN_ROWS[torch.float32] + 1], ids=["views", "contiguous-planes"])
@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_planes_are_the_output_columns_split_in_values_and_gradients(kernel, rows_each, library):
    """``planes=2`` gives ``[2, rows, out / 2]``: plane ``p`` is output columns ``p * out / 2`` onwards, with the
    gradients of the one-plane product. Where experts average ``PLANES_MIN_ROWS`` rows the CPU loop on MKL writes the
    planes contiguous (its gated activation then reads no strided halves), with the tail's rows zero in both; on
    oneDNN (float32 products, :mod:`moekit.moe.cpu_matmul`) it runs one product per expert and hands back views."""
    kernel_choices.set_choice(f"CPU_FLOAT32_MATMUL={library}")
    experts = 4
    if kernel == "bmm":
        counts = rows_each
        rows = experts * rows_each
    else:
        counts = torch.tensor([rows_each + 1, 0, 2 * rows_each, rows_each])  # an empty expert and a tail of 2
        rows = int(counts.sum()) + 2
    x = torch.randn(rows, 5, dtype=torch.float32, requires_grad=True)
    w = torch.randn(experts, 5, 6, dtype=torch.float32, requires_grad=True)
    b = torch.randn(experts, 6, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(rows, 6, dtype=torch.float32)
    planes = grouped_linear(x, w, b, counts, kernel, planes=2)
    assert planes.shape == (2, rows, 3)
    contiguous = planes[0].is_contiguous() and planes[1].is_contiguous()
    large = rows_each > PLANES_MIN_ROWS[torch.float32]
    assert contiguous == (kernel == "loop" and large and library == "mkl"), "planes contiguous where groups are large"
    planes.backward(grad.unflatten(-1, (2, 3)).transpose(0, 1))
    got = (planes.detach(), x.grad, w.grad, b.grad)
    x.grad = w.grad = b.grad = None
    one = grouped_linear(x, w, b, counts, kernel)
    one.backward(grad)
    torch.testing.assert_close(got[0], one.detach().unflatten(-1, (2, 3)).transpose(0, 1))
    for have, want in zip(got[1:], (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(have, want)


def test_planes_of_bf16_rows_and_float32_weights_cast_each_experts_plane():
    """Autocast's case on the CPU loop: bf16 rows, float32 parameters, contiguous planes from bf16's own (higher) row
    threshold. The planes are those of the one-plane product (each plane's product is a column block of it), the
    weight gradient comes back in float32, and the input gradient, summed over the planes in bf16, is the one-plane
    gradient to bf16's rounding."""
    least = PLANES_MIN_ROWS[torch.bfloat16]
    assert least > PLANES_MIN_ROWS[torch.float32]
    small = torch.full((4,), (least + PLANES_MIN_ROWS[torch.float32]) // 2)  # enough rows for float32, not for bf16
    x = torch.randn(int(small.sum()), 16).to(torch.bfloat16)
    assert not grouped_linear(x, torch.randn(4, 16, 8), None, small, "loop", planes=2)[1].is_contiguous()
    # 524 rows per expert on average, an empty expert among them
    counts = torch.tensor([2 * least + 7, 0, least, least + 40])
    x = torch.randn(int(counts.sum()), 16).to(torch.bfloat16).requires_grad_()
    w = torch.randn(4, 16, 8, requires_grad=True)
    grad = torch.randn(x.shape[0], 8).to(torch.bfloat16)
    planes = grouped_linear(x, w, None, counts, "loop", planes=2)
    assert planes.dtype == torch.bfloat16 and planes[1].is_contiguous()
    planes.backward(grad.unflatten(-1, (2, 4)).transpose(0, 1))
    got = (planes.detach(), x.grad, w.grad)
    x.grad = w.grad = None
    one = grouped_linear(x, w, None, counts, "loop")
    one.backward(grad)
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(got[0], one.detach().unflatten(-1, (2, 4)).transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(got[2], w.grad, rtol=0, atol=0)
    torch.testing.assert_close(got[1], x.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "dtype, onednn",
    [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)],
    ids=["bf16", "fp32-mkl", "fp32-onednn"],
)
def test_onednn_products_run_on_a_bounded_set_of_row_counts(dtype, onednn):
    """oneDNN builds a kernel per new shape: in bf16, and in float32 where oneDNN runs it, each expert's rows are cut
    into a multiple of ``ROW_BLOCK`` (``FLOAT32_ROW_BLOCK``) and a rest, so that any row count maps to shapes from a
    set of ``n / block + block`` sizes; MKL's float32 products take the rows whole."""
    block = kernel_choices.FLOAT32_ROW_BLOCK if dtype == torch.float32 else ROW_BLOCK
    sizes = [0, 1, block - 1, block, block + 1, 5 * block + 17, 7 * block]
    block_sizes, blocks = _row_blocks(sizes, torch.empty(0, dtype=dtype), onednn)
    assert blocks[0].start == 0 and blocks[-1].stop == len(block_sizes)
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:])), "each expert's blocks, in order"
    for n, parts in zip(sizes, blocks):
        lengths = [block_sizes[i] for i in parts]
        assert sum(lengths) == n
        if dtype == torch.float32 and not onednn:
            assert lengths == [n]
        else:
            assert all(length % block == 0 or length < block for length in lengths) and len(lengths) <= 2
            assert len(lengths) == (2 if n > block and n % block else 1)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
def test_the_loop_in_row_blocks_gives_the_whole_products(weight_dtype):
    """bf16 rows of ragged experts above ``ROW_BLOCK`` (run in two blocks each), bias and gate / up planes: values
    equal the float64 reference to bf16's rounding, and so do the gradients, whose weight part sums the blocks."""
    torch.manual_seed(0)
    least = PLANES_MIN_ROWS[torch.bfloat16]
    counts = torch.tensor([least + 3, 0, 2 * least + ROW_BLOCK // 2, least + 1])  # rests of 3, 32 and 1 rows
    x64 = torch.randn(int(counts.sum()) + 2, 16, dtype=torch.float64)
    w64, b64 = torch.randn(4, 16, 8, dtype=torch.float64) / 4, torch.randn(4, 8, dtype=torch.float64)
    grad64 = torch.randn(x64.shape[0], 8, dtype=torch.float64)
    x = x64.to(torch.bfloat16).requires_grad_()
    w, b = w64.to(weight_dtype).requires_grad_(), b64.to(weight_dtype).requires_grad_()
    planes = grouped_linear(x, w, b, counts, "loop", planes=2)
    assert planes[0].is_contiguous()
    planes.backward(grad64.to(torch.bfloat16).unflatten(-1, (2, 4)).transpose(0, 1))
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = _reference_grouped(xr[:-2], wr, br, counts.tolist())
    ref.backward(grad64.to(torch.bfloat16).double()[:-2])
    torch.testing.assert_close(planes.detach().double()[:, :-2], ref.detach().unflatten(-1, (2, 4)).transpose(0, 1),
                               rtol=2e-2, atol=5e-2)  # fmt: skip
    assert torch.all(planes[:, -2:] == 0) and torch.all(x.grad[-2:] == 0), "the tail"
    for have, want in zip((x.grad[:-2], w.grad, b.grad), (xr.grad[:-2], wr.grad, br.grad)):
        torch.testing.assert_close(have.double(), want, rtol=2e-2, atol=0.25)


def test_planes_must_divide_the_output_features():
    with pytest.raises(ValueError, match="planes=4 must be a positive divisor of the 6 output features"):
        grouped_linear(torch.randn(4, 2), torch.randn(2, 2, 6), None, torch.tensor([1, 3]), "loop", planes=4)


def test_bmm_kernel_rejects_ragged_groups():
    with pytest.raises(ValueError, match="equal rows per expert"):
        grouped_linear(torch.randn(4, 2), torch.randn(2, 2, 2), None, torch.tensor([1, 3]), "bmm")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm absent")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_kernel_pads_unaligned_features(dtype):
    """in=3 and out=5 are no 16-byte multiples (torch._grouped_mm refuses them): the kernel zero-pads them and
    gives the reference's outputs and gradients at the true sizes."""
    counts = [1, 0, 2]
    x = torch.randn(4, 3, dtype=dtype, requires_grad=True)  # one tail row
    w = torch.randn(3, 3, 5, dtype=dtype, requires_grad=True)
    b = torch.randn(3, 5, dtype=dtype, requires_grad=True)
    out = grouped_linear(x, w, b, torch.tensor(counts), "grouped_mm")
    assert out.shape == (4, 5)
    grad = torch.randn(4, 5, dtype=dtype)
    out.backward(grad)
    got = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None
    ref = torch.cat([_reference_grouped(x[:3], w, b, counts), torch.zeros(1, 5, dtype=dtype)])
    ref.backward(grad)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, ref, **tol)
    for g, r in zip(got, (x.grad, w.grad, b.grad)):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, **tol)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm absent")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planes", [1, 2])
def test_flop_counter_counts_the_grouped_mm_kernel_as_the_loop(planes, dtype, monkeypatch):
    """torch's FLOP counter has no formula for aten._grouped_mm, nor for the in-place addmm_ with which the loop adds
    a second plane's input gradient and a second row block's weight gradient; moekit's counts both: forward 2 M K N,
    input and weight gradients the same again each (in=16, out=8, 82 ragged rows, an expert of two bf16 row blocks),
    whichever kernel and path runs."""
    monkeypatch.setattr(kernel_choices, "PLANES_MIN_ROWS", {torch.float32: 1, torch.bfloat16: 1})
    counts = torch.tensor([ROW_BLOCK + 11, 0, 7])
    rows = int(counts.sum())
    flops = {}
    for kernel in ("loop", "grouped_mm"):
        x = torch.randn(rows, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(3, 16, 8, dtype=dtype, requires_grad=True)
        with flop_counter() as counter:
            out = grouped_linear(x, w, None, counts, kernel, planes=planes)
            out.backward(torch.randn_like(out))
        flops[kernel] = counter.get_total_flops()
    assert flops["loop"] == 3 * 2 * rows * 16 * 8
    assert flops["grouped_mm"] == flops["loop"]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kernel", ["loop", "bmm"])
def test_expert_bank_matches_reference_experts(gated, kernel):
    bank = ExpertBank(3, 5, 8, 4, act_layer=nn.SiLU if gated else nn.GELU, gated=gated, kernel=kernel)
    x = torch.randn(3 * 4, 5)
    out = bank(x, 4)
    ref = torch.cat([reference_expert(bank, e, x[4 * e : 4 * e + 4]) for e in range(3)])
    torch.testing.assert_close(out, ref)


def test_expert_bank_init_modes():
    independent = ExpertBank(4, 6, 8, init="independent")
    assert not torch.equal(independent.fc1_weight[0], independent.fc1_weight[1])
    bound = 1 / 6**0.5  # nn.Linear's default bound for fan_in 6
    assert independent.fc1_weight.abs().max() <= bound
    shared = ExpertBank(4, 6, 8, init="shared")
    for p in (shared.fc1_weight, shared.fc1_bias, shared.fc2_weight, shared.fc2_bias):
        assert torch.equal(p, p[:1].expand_as(p)), "all experts start from one draw"
    assert not torch.equal(shared.fc1_weight[0], torch.zeros_like(shared.fc1_weight[0]))
    normal = ExpertBank(64, 32, 64, init="shared")
    normal.init_normal_(0.02, 0.005, truncate=True)
    assert normal.fc1_weight.abs().max() <= 0.04 + 1e-7 and torch.all(normal.fc1_bias == 0)
    assert normal.fc2_weight.abs().max() <= 0.01 + 1e-7 and torch.all(normal.fc2_bias == 0)
    assert torch.equal(normal.fc1_weight, normal.fc1_weight[:1].expand_as(normal.fc1_weight)), "init mode kept"
    # a normal cut at two std has std 0.88 sigma
    assert normal.fc1_weight[0].std().item() == pytest.approx(0.02 * 0.88, rel=0.05)
    gpt2 = ExpertBank(8, 64, 64)
    gpt2.init_normal_(0.02)
    assert gpt2.fc1_weight.abs().max() > 0.04, "not truncated"
    assert gpt2.fc1_weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize(
    "dense, gated",
    [
        (Mlp(6, 10, 5), False),
        (SwiGLU(6, 10, 5), True),
        (GluMlp(6, 20, 5, act_layer=nn.SiLU), True),  # timm GluMlp halves hidden: 20 -> 10
        (GluMlp(6, 20, 5, act_layer=nn.SiLU, gate_last=False), True),  # the gate in the first half
    ],
)
def test_load_dense_mlp_makes_every_expert_the_dense_mlp(dense, gated):
    dense.eval()
    bank = ExpertBank(3, 6, 10, 5, act_layer=nn.SiLU if gated else nn.GELU, gated=gated).eval()
    bank.load_dense_mlp(dense)
    x = torch.randn(9, 6)
    torch.testing.assert_close(bank(x, 3), dense(x))


def test_load_dense_mlp_shape_mismatch_is_a_clear_error():
    bank = ExpertBank(2, 6, 12, 6)
    with pytest.raises(ValueError, match="do not match"):
        bank.load_dense_mlp(Mlp(6, 10, 6))


def test_expert_bank_bad_arguments():
    with pytest.raises(ValueError, match="num_experts"):
        ExpertBank(0, 4, 4)
    with pytest.raises(ValueError, match="init="):
        ExpertBank(2, 4, 4, init="orthogonal")
    with pytest.raises(ValueError, match="kernel="):
        ExpertBank(2, 4, 4, kernel="cuda")


def test_expert_bank_under_bf16_autocast_runs_in_bf16():
    bank = ExpertBank(2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bank(torch.randn(6, 4), 3)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_cpu_loop_casts_float32_weights_expert_by_expert_as_casting_the_bank_first_does(
    path, with_bias, monkeypatch
):
    """bf16 rows with the float32 parameters autocast leaves them: the loop casts each expert's weights as it runs
    its product, and its values and gradients are those of the bank cast first (the bias gradient is summed with
    float32 accumulation and rounded once, as the batched kernels do, not rounded at each add). The compiled path's
    custom operator does the same."""
    from moekit.moe.grouped_linear import _loop_op

    monkeypatch.setattr(kernel_choices, "FLOAT32_EXPERT_ROWS", {})  # no expert in float32, whatever the CPU
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 3, 1])  # an empty expert; 16 rows plus a tail of 2
    x = torch.randn(18, 8).to(torch.bfloat16).requires_grad_()
    w = torch.randn(5, 8, 6, requires_grad=True)
    b = torch.randn(5, 6, requires_grad=True) if with_bias else None
    grad = torch.randn(18, 6).to(torch.bfloat16)

    def run(weight, bias):
        if path == "custom_op":
            return _loop_op(x, weight, bias, counts, 1)
        return grouped_linear(x, weight, bias, counts, "loop")

    out = run(w, b)
    out.backward(grad)
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    got = [out.detach(), x.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if with_bias else [])
    for t in [x, w] + ([b] if with_bias else []):
        t.grad = None
    ref = run(w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16))
    ref.backward(grad)
    for name, have, want in zip(["out", "x", "w"], got, [ref.detach(), x.grad, w.grad]):
        assert torch.equal(have, want), name
    if with_bias:
        exact = torch.stack([grad[:5].float().sum(0), torch.zeros(6), *(grad[s:e].float().sum(0) for s, e in
                             [(5, 12), (12, 15), (15, 16)])])  # fmt: skip
        torch.testing.assert_close(got[3], exact, rtol=2**-8, atol=1e-6)  # one bf16 rounding of the float32 sum
        torch.testing.assert_close(got[3], b.grad, rtol=0, atol=0.05)  # bf16 sums, rounded at each add


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_the_cpu_loop_runs_experts_of_few_rows_in_float32_under_bf16(planes, library, monkeypatch):
    """bf16 rows, float32 weights cast per expert, on a CPU with matrix units (``FLOAT32_EXPERT_ROWS``): an expert of
    fewer rows runs
    its products in float32 on the float32 weights, on either float32 library. Its weight gradient is the exact sum
    to float32's precision (the bf16 path rounds it to bf16), its outputs and input gradient the float32 products
    rounded once to bf16; the other experts give what the bank cast to bf16 first gives, bit for bit."""
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: "AMX")
    monkeypatch.setattr(kernel_choices, "LOOP_WEIGHT_CAST", {"AMX": "expert"})
    monkeypatch.setattr(kernel_choices, "FLOAT32_EXPERT_ROWS", {"AMX": 6})
    kernel_choices.set_choice(f"CPU_FLOAT32_MATMUL={library}")
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 3, 1])  # experts 0, 3 and 4 in float32; 16 rows plus a tail of 2
    x = torch.randn(18, 8).to(torch.bfloat16).requires_grad_()
    w, b = torch.randn(5, 8, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    grad = torch.randn(18, 6).to(torch.bfloat16)

    def run(weight, bias):
        out = grouped_linear(x, weight, bias, counts, "loop", planes=planes)
        out.backward(grad if planes == 1 else grad.unflatten(-1, (2, 3)).transpose(0, 1))
        out = out if planes == 1 else out.transpose(0, 1).flatten(-2)
        return out.detach(), x.grad.clone(), w.grad.clone()  # a cast bank's gradient reaches w too

    out, gx, gw = run(w, b)
    x.grad = w.grad = b.grad = None
    ref_out, ref_gx, ref_gw = run(w.to(torch.bfloat16), b.to(torch.bfloat16))  # every expert in bf16
    big = slice(5, 12)  # expert 2's rows
    assert torch.equal(out[big], ref_out[big]) and torch.equal(gx[big], ref_gx[big]) and torch.equal(gw[2], ref_gw[2])
    assert torch.all(gw[1] == 0)
    x64, w64, g64 = x.detach().double(), w.detach().double(), grad.double()
    for e, rows in ((0, slice(0, 5)), (3, slice(12, 15)), (4, slice(15, 16))):
        want_out = x64[rows] @ w64[e] + b.detach().double()[e]
        torch.testing.assert_close(out[rows].double(), want_out, rtol=2**-8, atol=1e-6)  # rounded once to bf16
        torch.testing.assert_close(gx[rows].double(), g64[rows] @ w64[e].T, rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(gw[e].double(), x64[rows].T @ g64[rows], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(ref_gw[e].double(), x64[rows].T @ g64[rows], rtol=1e-5, atol=1e-6), "bf16's"


@pytest.mark.parametrize("planes", [1, 2])
def test_the_cpu_loop_casts_float32_weights_per_expert_or_once_with_the_same_values(planes, monkeypatch):
    """``LOOP_WEIGHT_CAST``: bf16 rows on float32 weights, the loop casting each expert's weights as it runs and again
    in the backward, or once, into a bf16 copy of the bank that the backward reads (each non-empty expert's the cast
    of its weights), or with the whole bank cast before the loop (as under ``torch.compile``): the same outputs and
    gradients, bit for bit, the gradients float32."""
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: "AMX")
    monkeypatch.setattr(kernel_choices, "FLOAT32_EXPERT_ROWS", {})
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 3, 1])
    x = torch.randn(18, 8).to(torch.bfloat16).requires_grad_()
    w, b = torch.randn(5, 8, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    grad = torch.randn(18, 6).to(torch.bfloat16)
    results = []
    for cast in ("expert", "bank", "bank first"):
        monkeypatch.setattr(kernel_choices, "LOOP_WEIGHT_CAST", {"AMX": cast.split()[0]})
        monkeypatch.setattr(grouped_linear_module, "_keeps_cast", lambda x, keeps=cast == "bank": keeps)
        out = grouped_linear(x, w, b, counts, "auto", planes=planes)
        node = out.grad_fn  # the loop's autograd node, under the views that make the planes
        while "LoopGroupedLinear" not in type(node).__name__:
            node = node.next_functions[0][0]
        _, saved_w, _ = node.saved_tensors
        if cast == "bank":  # the copy the forward wrote, expert by expert
            assert saved_w.dtype == torch.bfloat16
            assert torch.equal(saved_w[counts > 0], w.detach()[counts > 0].to(torch.bfloat16))
        out.backward(grad if planes == 1 else grad.unflatten(-1, (2, 3)).transpose(0, 1))
        assert w.grad.dtype == b.grad.dtype == torch.float32
        results.append((out.detach(), x.grad, w.grad, b.grad))
        x.grad = w.grad = b.grad = None
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_bank_larger_than_the_memory_left_is_refused_with_the_size(monkeypatch):
    import moekit.utils.machine as machine

    monkeypatch.setattr(machine, "available_memory", lambda device: 2**20)  # 1 MiB left
    with pytest.raises(
        ValueError,
        match=r"num_experts=64 experts of 32,768 weights each need 8\.0 MiB.*but 1\.0 MiB are available.*use fewer",
    ):
        ExpertBank(64, 64, 256)  # 64 * (64 * 256 + 256 * 64) float32 weights: 8 MiB
    ExpertBank(4, 64, 256)  # 512 KiB fits


def test_a_layer_whose_weights_cannot_fit_is_refused_before_any_is_allocated(monkeypatch):
    """The layer is measured on the meta device first: the refusal names the whole layer (Soft MoE's slot
    parameters grow with the experts too) and comes before the slots or the bank take memory."""
    import moekit.utils.machine as machine
    from moekit.moe import SoftMoE

    left = {"cpu": 2**20}  # 1 MiB; the meta device's memory is unknown (None), as in available_memory
    monkeypatch.setattr(machine, "available_memory", lambda device: left.get(torch.device(device or "cpu").type))
    allocated = []
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda *a, **k: allocated.append(a[0].device))
    weights = 64 * (64 * 256 + 256 * 64) + 64 * 256 + 64 * 64 + 64 * 64 + 1  # experts, their biases, Phi, scale
    with pytest.raises(ValueError, match=rf"SoftMoE\(num_experts=64, .*\) with {weights:,} weights need 8\.[0-9] MiB"):
        SoftMoE(64, 256, num_experts=64)
    assert all(device.type == "meta" for device in allocated)  # only the measuring build drew anything


def test_measuring_a_layer_first_leaves_its_random_draws_alone(monkeypatch):
    from moekit.moe import MoELayer, build_moe_layer

    def build():
        torch.manual_seed(0)
        layer = build_moe_layer("vmoe", in_features=16, hidden_features=32)
        return [*layer.state_dict().values(), torch.randn(4)]

    measured = build()
    assert (
        len(build_moe_layer("strictly_balanced", in_features=16, hidden_features=32)._load_state_dict_post_hooks) == 1
    )  # not twice
    monkeypatch.setattr(MoELayer, "_refuse_what_cannot_fit", lambda *args: None)
    for a, b in zip(measured, build(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm absent")
def test_auto_leaves_grouped_mm_for_the_loop_where_it_would_fail(monkeypatch):
    """On CUDA, ragged groups take grouped_mm in bf16 and float32, but not in float32 under ``torch.compile`` (whose
    meta function for ``torch._grouped_mm`` refuses float32) nor in float16. Fake CUDA tensors: no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = {dtype: torch.empty(8, 16, device="cuda", dtype=dtype) for dtype in (torch.bfloat16, torch.float32)}
        x_half = torch.empty(8, 16, device="cuda", dtype=torch.float16)
    assert [_resolve_kernel("auto", t, equal_groups=False) for t in x.values()] == ["grouped_mm", "grouped_mm"]
    assert _resolve_kernel("auto", x_half, equal_groups=False) == "loop"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _resolve_kernel("auto", x[torch.bfloat16], equal_groups=False) == "grouped_mm"
    assert _resolve_kernel("auto", x[torch.float32], equal_groups=False) == "loop"
