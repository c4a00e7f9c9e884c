"""Float32 CPU products on oneDNN (moekit.moe.cpu_matmul): the same values and gradients as torch's own operators,
the library's choice, and where the plain operators must run instead."""

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import moekit.models  # noqa: F401  (registers the ViTs)
from moekit.moe import cpu_matmul, kernel_choices
from moekit.moe.cpu_matmul import Linear, adopt_linears, float32_library, linear, takes_onednn
from moekit.moe.grouped_linear import _resolve_kernel, grouped_linear
from moekit.utils.machine import machine_info

pytestmark = pytest.mark.skipif(cpu_matmul._onednn_op() is None, reason="this torch has no oneDNN matmul")


@pytest.fixture
def onednn():
    kernel_choices.set_choice("CPU_FLOAT32_MATMUL=onednn")  # the conftest fixture restores the table


def _grads(fn, *inputs):
    """``fn``'s output and the gradients of every input for a fixed output gradient."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return [out.detach()] + [t.grad for t in inputs]


@pytest.mark.parametrize("shape", [(37, 24), (3, 11, 24)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_on_onednn_matches_float64(onednn, shape, bias):
    """``y = x W^T + b`` and its three gradients (``dy W``, ``dy^T x``, ``sum dy``) against float64 ``F.linear``."""
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(40, 24)
    inputs = (x, w, torch.randn(40)) if bias else (x, w)
    assert takes_onednn(x)
    got = _grads(lambda *t: linear(*t), *inputs)
    want = _grads(lambda *t: F.linear(*t), *(t.double() for t in inputs))
    assert len(got) == len(want)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r.float(), rtol=1e-5, atol=1e-4)


def test_linear_passes_one_gradient_when_one_is_asked(onednn):
    """A frozen weight (fine-tuning) and an input without a gradient: only what is asked is computed."""
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(3, 8)
    linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(5, 8))
    w.requires_grad_()
    x2 = torch.randn(5, 8)
    linear(x2, w).sum().backward()
    torch.testing.assert_close(w.grad, x2.sum(0).expand(3, 8))


def test_the_plain_operators_run_under_autocast_other_dtypes_and_the_flop_counter(onednn):
    """bf16 autocast must cast (oneDNN's float32 op would not), float64 and bf16 are not oneDNN's float32 products,
    and the FLOP counter sees ATen's matmuls only: under it the count is the plain operators'."""
    x = torch.randn(4, 8)
    assert takes_onednn(x)
    assert not takes_onednn(x.double()) and not takes_onednn(x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_onednn(x)
        assert linear(x, torch.randn(3, 8)).dtype == torch.bfloat16
    layer = adopt_linears(nn.Linear(8, 3))
    with FlopCounterMode(display=False) as counter:
        assert not takes_onednn(x)
        layer(x)
    assert counter.get_total_flops() == 2 * 4 * 8 * 3


def test_mkl_runs_torch_s_own_operators():
    kernel_choices.set_choice("CPU_FLOAT32_MATMUL=mkl")
    assert float32_library() == ("mkl", "set by kernel_choices.CPU_FLOAT32_MATMUL")
    assert not takes_onednn(torch.randn(2, 2))


@pytest.mark.parametrize("planes", [1, 2])
def test_the_experts_loop_on_onednn_matches_float64(onednn, planes):
    """Ragged experts (an empty one, one past ``FLOAT32_ROW_BLOCK`` in two blocks, rows past the last group), with
    bias and gate / up planes: outputs and the three gradients equal float64's, the tail's zero."""
    torch.manual_seed(1)
    block = kernel_choices.FLOAT32_ROW_BLOCK
    counts = torch.tensor([3, 0, block + 5, 1])
    x, w, b = torch.randn(int(counts.sum()) + 2, 12), torch.randn(4, 12, 10), torch.randn(4, 10)

    def run(x, w, b):
        out = grouped_linear(x, w, b, counts, "loop", planes=planes)
        return out if planes == 1 else out.transpose(0, 1).flatten(-2)

    got = _grads(run, x, w, b)
    want = _grads(run, x.double(), w.double(), b.double())
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r.float(), rtol=1e-5, atol=1e-4)
    assert got[0][-2:].abs().sum() == 0 and got[1][-2:].abs().sum() == 0


def test_equal_groups_take_the_loop_where_onednn_runs_them():
    """oneDNN's per-expert products beat MKL's batched one: ``auto`` takes the loop for equal groups in float32 only
    where oneDNN runs them."""
    x = torch.randn(8, 4)
    kernel_choices.set_choice("CPU_FLOAT32_MATMUL=mkl")
    assert _resolve_kernel("auto", x, equal_groups=True) == "bmm"
    kernel_choices.set_choice("CPU_FLOAT32_MATMUL=onednn")
    assert _resolve_kernel("auto", x, equal_groups=True) == "loop"
    assert _resolve_kernel("auto", x.bfloat16(), equal_groups=True) == "bmm"
    assert _resolve_kernel("bmm", x, equal_groups=True) == "bmm", "an asked-for kernel stays"


def test_adopt_linears_changes_only_plain_linears_classes():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 5), nn.Sequential(nn.ReLU(), nn.Linear(5, 2)), Custom(2, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[0].weight
    assert adopt_linears(model) is model
    assert type(model[0]) is Linear and type(model[1][1]) is Linear and type(model[2]) is Custom
    assert model[0].weight is weight and isinstance(model[0], nn.Linear)
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], v) for k, v in after.items())


@pytest.mark.parametrize("name", ["soft_moe_vit_tiny_patch4_28", "top2_moe_vit_tiny_patch4_28"])
def test_a_vit_training_step_is_the_same_on_either_library(name):
    """moekit's ViTs adopt their linears: a float32 training step's loss and gradients on oneDNN equal MKL's up to
    the order of float32 sums."""
    torch.manual_seed(0)
    model = timm.create_model(name, embed_dim=32, num_heads=2)
    assert any(type(m) is Linear for m in model.modules()) and not any(type(m) is nn.Linear for m in model.modules())
    images, labels = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    results = {}
    for library in ("mkl", "onednn"):
        kernel_choices.set_choice(f"CPU_FLOAT32_MATMUL={library}")
        model.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        results[library] = [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(results["mkl"]) == len(results["onednn"]) > 10
    for a, b in zip(results["mkl"], results["onednn"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.fixture
def fresh_choice():
    """``auto``'s choice is kept per process: forget it before and after a test that fakes the CPU."""
    cpu_matmul._auto_choice.cache_clear()
    yield
    cpu_matmul._auto_choice.cache_clear()


def test_auto_follows_the_table_of_cpu_families(monkeypatch, fresh_choice):
    """``auto`` is a property of the CPU, not a timing: oneDNN on the families of ``ONEDNN_FLOAT32_CPUS``, MKL
    elsewhere, said why; a change of the table takes effect; the run record names it."""
    monkeypatch.setattr(cpu_matmul, "_this_cpu", lambda: "AMD family 26")
    assert float32_library() == ("onednn", "AMD family 26 is in kernel_choices.ONEDNN_FLOAT32_CPUS")
    assert machine_info()["cpu_float32_matmul"] == {"library": "onednn", "reason": float32_library()[1]}
    kernel_choices.set_choice("ONEDNN_FLOAT32_CPUS=AMD family 25")
    assert float32_library() == ("mkl", "AMD family 26 is not in kernel_choices.ONEDNN_FLOAT32_CPUS")
    monkeypatch.setattr(cpu_matmul, "_this_cpu", lambda: None)
    kernel_choices.reset()
    cpu_matmul._auto_choice.cache_clear()
    assert float32_library() == ("mkl", "this CPU is not in kernel_choices.ONEDNN_FLOAT32_CPUS")


def test_the_cpu_family_is_read_from_cpuinfo(monkeypatch, tmp_path):
    from moekit.utils import machine

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\nprocessor\t: 1\n")
    monkeypatch.setattr(machine, "_CPUINFO", cpuinfo)
    assert machine.cpu_family() == "AMD family 26"
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")
    assert machine.cpu_family() is None


def test_the_choice_is_one_of_its_paths():
    with pytest.raises(ValueError, match="CPU_FLOAT32_MATMUL='blas'.*'onednn'"):
        kernel_choices.set_choice("CPU_FLOAT32_MATMUL=blas")
    with pytest.raises(ValueError, match="one path"):
        kernel_choices.set_choice("CPU_FLOAT32_MATMUL[cpu]=mkl")
    kernel_choices.set_choice("CPU_FLOAT32_MATMUL=onednn")
    assert kernel_choices.changes() == ["CPU_FLOAT32_MATMUL=onednn"]
