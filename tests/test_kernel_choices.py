"""The table of kernel and path choices (moekit.moe.kernel_choices): valid entries, read when a layer runs, and every
choice the same layer."""

import copy

import pytest
import torch
from torch import nn

from moekit.moe import TopKMoE, kernel_choices
from moekit.moe.assignment import resolve_solver
from moekit.moe.dispatch import combine, plan_dispatch

CPU = torch.device("cpu")


def test_the_tables_entries_name_paths_the_code_has():
    kernels = set(kernel_choices.AUTO_KERNELS.values())
    assert kernels <= {"loop", "bmm", "grouped_mm"}
    assert all(kernel != "bmm" for (_, layout), kernel in kernel_choices.AUTO_KERNELS.items() if layout == "ragged")
    assert {layout for _, layout in kernel_choices.AUTO_KERNELS} <= {"equal", "ragged"}
    assert set(kernel_choices.DISPATCH_GRADIENT.values()) <= {"index_add", "gather"}
    assert set(kernel_choices.BASE_SOLVERS.values()) <= {"exact", "sync_free"}
    assert set(kernel_choices.PATCHIFY_KERNELS.values()) <= {"conv", "matmul"}
    counts = [
        kernel_choices.ROW_BLOCK,
        kernel_choices.MIN_EXPERTS_PER_THREAD,
        *kernel_choices.BF16_MIN_EXPERTS_PER_THREAD.values(),
        *kernel_choices.BF16_SPREAD_MIN_ROWS.values(),
        kernel_choices.SORT_RADIX_FROM,
        *kernel_choices.PLANES_MIN_ROWS.values(),
        *kernel_choices.SOFTMAX_PAD_LANES.values(),
        *kernel_choices.COMBINE_BMM_MIN_MACS.values(),
    ]
    assert all(isinstance(n, int) and n > 0 for n in counts)
    assert torch.bfloat16 in kernel_choices.PLANES_MIN_ROWS, "the fallback of other reduced-precision dtypes"


def test_the_layers_read_the_table_when_they_run(monkeypatch):
    """A value changed after import takes effect: the BASE solver and the combine follow it."""
    assert resolve_solver("auto", CPU) == "exact"
    monkeypatch.setitem(kernel_choices.BASE_SOLVERS, "cpu", "sync_free")
    assert resolve_solver("auto", CPU) == "sync_free"

    expert_ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    plan = plan_dispatch(expert_ids, 2)
    out = torch.randn(6, 300, dtype=torch.float64)  # k * o = 600 multiply-adds a token
    gates = torch.rand(3, 2, dtype=torch.float64)
    bmm_calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: bmm_calls.append(1) or bmm(*a))
    want = combine(out, plan, gates)
    assert bmm_calls, "float64 on a CPU from 400 multiply-adds: the batched matmul"
    monkeypatch.setitem(kernel_choices.COMBINE_BMM_MIN_MACS, "cpu", 10**6)
    bmm_calls.clear()
    torch.testing.assert_close(combine(out, plan, gates), want)
    assert not bmm_calls


def _flip_the_loops_choices(monkeypatch) -> None:
    """Every CPU choice of the table around the loop kernel to its other path."""
    monkeypatch.setattr(kernel_choices, "PLANES_MIN_ROWS", {torch.float32: 1, torch.bfloat16: 1})
    monkeypatch.setattr(kernel_choices, "MIN_EXPERTS_PER_THREAD", 1)
    monkeypatch.setattr(kernel_choices, "SORT_RADIX_FROM", 1)
    monkeypatch.setattr(kernel_choices, "SOFTMAX_PAD_LANES", {})
    monkeypatch.setattr(kernel_choices, "DISPATCH_GRADIENT", {})
    monkeypatch.setattr(kernel_choices, "COMBINE_BMM_MIN_MACS", {})
    monkeypatch.setattr(kernel_choices, "COMBINE_PAIR_DEVICES", set())


def _grouped_mm_on_cpus(monkeypatch) -> None:
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("needs torch._grouped_mm")
    monkeypatch.setitem(kernel_choices.AUTO_KERNELS, ("cpu", "ragged"), "grouped_mm")


@pytest.mark.parametrize("flip", [_flip_the_loops_choices, _grouped_mm_on_cpus], ids=["loop-paths", "grouped_mm"])
@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_every_cpu_choice_gives_the_same_layer(flip, gated, monkeypatch):
    """A top-2 layer with capacity and Batch Prioritized Routing, forward and backward, with the table as shipped and
    with the CPU's choices flipped (planes, threads, radix sorts, unpadded softmax, gathered gradients, the combine's
    multiply and sum; or grouped_mm for the loop): the same outputs and gradients (float32 rounding)."""
    torch.manual_seed(0)
    act = nn.SiLU if gated else nn.GELU
    layer = TopKMoE(
        32, 48, num_experts=8, top_k=2, capacity_factor=1.0, batch_priority=True, gated=gated, act_layer=act
    )
    x = torch.randn(4, 50, 32)
    grad = torch.randn(4, 50, 32)

    def run():
        layer.zero_grad(set_to_none=True)
        x_ = x.clone().requires_grad_()
        y = layer(x_)
        (y * grad).sum().backward()
        return y.detach(), x_.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    y, gx, grads = run()
    flip(monkeypatch)
    y2, gx2, grads2 = run()
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(gx2, gx)
    for name, g in grads.items():
        torch.testing.assert_close(grads2[name], g, msg=name)


def test_set_choice_sets_entries_and_changes_gives_the_specs_back():
    table = kernel_choices
    assert table.changes() == []
    specs = [
        "ROW_BLOCK=128",
        "AUTO_KERNELS[cpu,ragged]=grouped_mm",
        "PLANES_MIN_ROWS[float32]=64",
        "DISPATCH_GRADIENT[cpu]=",
        "COMBINE_PAIR_DEVICES=",
        "SOFTMAX_PAD_LANES[AVX2]=16",
    ]
    for spec in specs:
        table.set_choice(spec)
    assert table.ROW_BLOCK == 128
    assert table.AUTO_KERNELS["cpu", "ragged"] == "grouped_mm" and table.AUTO_KERNELS["cpu", "equal"] == "bmm"
    assert table.PLANES_MIN_ROWS == {torch.float32: 64, torch.bfloat16: 512}
    assert "cpu" not in table.DISPATCH_GRADIENT
    assert table.COMBINE_PAIR_DEVICES == set()
    assert table.SOFTMAX_PAD_LANES == {"AVX512": 16, "AVX2": 16}
    recorded = table.changes()
    assert sorted(recorded) == sorted(specs)
    state = {name: copy.deepcopy(getattr(table, name)) for name in table._ENTRIES}
    table.reset()  # back to the shipped table, then what changes() recorded: the same state
    assert table.changes() == [] and table.ROW_BLOCK == 64 and "cpu" in table.DISPATCH_GRADIENT
    for spec in recorded:
        table.set_choice(spec)
    assert {name: getattr(table, name) for name in table._ENTRIES} == state
    table.set_choice("COMBINE_PAIR_DEVICES=cpu, cuda")
    assert table.COMBINE_PAIR_DEVICES == {"cpu", "cuda"}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ROW_BLOCK", "expected NAME=VALUE"),
        ("NO_SUCH=1", "NAME one of"),
        ("ROW_BLOCK=0", "positive int"),
        ("ROW_BLOCK=big", "positive int"),
        ("ROW_BLOCK[cpu]=3", "one number"),
        ("AUTO_KERNELS=loop", r"is a table: set one key as AUTO_KERNELS\[KEY\]=VALUE, e.g. AUTO_KERNELS\[cpu,equal\]"),
        ("AUTO_KERNELS[cpu]=loop", "its keys are 2 names"),
        ("AUTO_KERNELS[cpu,ragged]=fast", r"choose from \['bmm', 'grouped_mm', 'loop'\]"),
        ("AUTO_KERNELS[cpu,ragged]=bmm", "bmm needs equal groups"),
        ("PLANES_MIN_ROWS[float33]=4", "not a torch dtype"),
        ("COMBINE_PAIR_DEVICES[cpu]=1", "a set of device types"),
    ],
)
def test_a_bad_choice_is_refused_with_the_fix_and_sets_nothing(spec, message):
    table = kernel_choices
    with pytest.raises(ValueError, match=message):
        table.set_choice(spec)
    assert table.changes() == []


def test_a_removed_key_takes_the_codes_default_path():
    """``NAME[KEY]=`` removes a key; the layer then takes the path the code has without one (planes: views of one
    output), with the same values."""
    torch.manual_seed(0)
    layer = TopKMoE(16, 24, num_experts=4, top_k=2, gated=True, act_layer=nn.SiLU)
    x = torch.randn(2, 40, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        kernel_choices.set_choice("PLANES_MIN_ROWS[bfloat16]=")
        kernel_choices.set_choice("PLANES_MIN_ROWS[float32]=")
        assert kernel_choices.PLANES_MIN_ROWS == {}
        torch.testing.assert_close(layer(x), want)


def test_a_change_leaves_a_table_read_before_it_as_it_was():
    """``set_choice`` puts a new table in place: a module that imported an entry (``from moekit.moe.kernel_choices
    import PLANES_MIN_ROWS``) keeps the values it read, and ``reset`` brings the shipped ones back for everyone."""
    imported = kernel_choices.PLANES_MIN_ROWS
    read = dict(imported)
    kernel_choices.set_choice("PLANES_MIN_ROWS[float32]=")
    kernel_choices.set_choice("PLANES_MIN_ROWS[bfloat16]=7")
    assert kernel_choices.PLANES_MIN_ROWS == {torch.bfloat16: 7}
    assert imported == read
    kernel_choices.reset()
    assert kernel_choices.PLANES_MIN_ROWS == read
