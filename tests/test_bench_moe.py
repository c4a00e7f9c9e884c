"""The layer benchmark (scripts/bench_moe.py, moekit.analysis.bench_layers): the timed step is forward +
backward of the layer in the chosen precision, a candidate that fails is skipped (not fatal), and a smoke run prints
each table with its baseline at 1.00x."""

import re

import pytest
import torch
from timm.layers import Mlp
from torch import nn

from moekit.analysis import bench_layers as bench
from moekit.analysis import peak
from moekit.moe import SoftMoE
from moekit.recipes import list_recipes

pytestmark = pytest.mark.usefixtures("one_thread_no_reexec")


class _RecordsDtype(nn.Module):
    """A linear layer that remembers the dtype its forward computed in."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x):
        y = self.linear(x)
        self.dtypes.append(y.dtype)
        return y


class _Fails(nn.Module):
    def forward(self, x):
        raise RuntimeError("needs 36 GiB\nsecond line")


@pytest.mark.parametrize("autocast, expected", [(None, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_timed_step_runs_forward_and_backward_in_the_backends_precision(autocast, expected):
    layer = _RecordsDtype()
    x = torch.randn(4, 8, requires_grad=True)
    times = bench.time_candidates([bench.Candidate("probe", layer)], x, 2, bench.Backend(autocast=autocast))
    assert set(layer.dtypes) == {expected}
    assert len(layer.dtypes) == 4  # the output-shape probe, the warm-up step and 2 rounds
    assert times["probe"] > 0
    assert layer.linear.weight.grad is not None and x.grad is not None  # backward ran
    assert layer.linear.weight.grad.dtype == torch.float32  # autocast never changes the parameters


def test_a_failing_candidate_is_skipped_and_said_so(capsys):
    x = torch.randn(2, 5, 8, requires_grad=True)
    cands = [bench.Candidate("mlp", Mlp(8, 16)), bench.Candidate("broken", _Fails())]
    times = bench.time_candidates(cands, x, 1)
    assert list(times) == ["mlp"] and [c.name for c in cands] == ["mlp"]
    assert "(broken: skipped, needs 36 GiB)" in capsys.readouterr().out


def test_soft_moe_under_bf16_autocast_keeps_its_router_in_float32():
    """The benchmark's bf16 setting times the layer as training runs it: the dispatch / combine
    logits in float32 (the router), the experts in bf16."""
    layer = SoftMoE(16, 32, num_experts=4, slots_per_expert=2)
    x = torch.randn(2, 6, 16, requires_grad=True)
    with bench.Backend(autocast=torch.bfloat16).precision():
        y = layer(x)
        logits = layer.compute_logits(x)
        dispatch, combine = layer.routing_weights(x)
    assert y.dtype == torch.bfloat16  # the experts ran under autocast
    assert logits.dtype == dispatch.dtype == combine.dtype == torch.float32
    torch.testing.assert_close(logits, layer.compute_logits(x.double()).float(), rtol=1e-5, atol=1e-6)


def _rows(out: str) -> dict[str, list[list[str]]]:
    tables, title = {}, None
    for line in out.splitlines():
        if line.startswith("### "):
            title = line[4:]
            tables[title] = []
        elif title and line.startswith("| ") and not line.startswith(("| layer |", "| experts |")):
            tables[title].append([cell.strip() for cell in line.strip("|").split("|")])
    return tables


def test_quick_run_prints_tables_with_the_baseline_at_one(capsys):
    bench.main(["--quick", "--rounds", "1", "--allocator", "system", "--tables", "recipes", "scaling"])
    out = capsys.readouterr().out
    assert out.startswith("# moekit layer benchmark: torch ")
    assert "fp32, forward + backward, batch x1" in out
    assert re.search(r"matmul peak \d+\.\d GFLOP/s \(4096\^3 float32 matmul, (torch\.mm|oneDNN)", out)
    tables = _rows(out)
    layers = next(rows for title, rows in tables.items() if title.startswith("Every recipe as shipped"))
    assert layers[0][0] == "dense Mlp" and layers[0][4] == "1.00x"
    assert [row[0].split(" (")[0] for row in layers[1:]] == list_recipes()  # every recipe, none skipped
    assert "soft_moe (128 experts, compute 0.65x)" in [row[0] for row in layers]  # its stated compute
    assert all(float(row[1]) > 0 and float(row[2]) > 0 and row[3].endswith("%") for row in layers)
    scaling = next(rows for title, rows in tables.items() if title.startswith("Scaling experts"))
    assert [row[0] for row in scaling] == ["4", "8", "16"]
    assert "Soft MoE: 16 slots in total, 16 / experts for each expert; " in out  # the quick shapes, not the full ones
    assert all(re.fullmatch(r"\d+\.\d \(\d+\.\d\dx\)", cell) for row in scaling for cell in row[2:])


def test_the_dropout_table_times_moekit_against_torch(capsys):
    bench.main(["--quick", "--rounds", "1", "--allocator", "system", "--tables", "dropout"])
    tables = {title: [r for r in rows if r[0] != "kernel"] for title, rows in _rows(capsys.readouterr().out).items()}
    activation, attention = tables.values()
    assert [row[0] for row in activation] == ["torch nn.Dropout", "moekit Dropout"]
    assert [row[0] for row in attention] == [
        "torch sdpa, dropout",
        "moekit attention_with_dropout",
        "torch sdpa, no dropout",
    ]
    for rows in (activation, attention):
        assert rows[0][2] == "1.00x" and all(float(row[1]) > 0 for row in rows)
        first = float(rows[0][1])
        for row in rows[1:]:  # each ratio is its time over the first row's; the times shown are rounded to 0.1 ms
            time = float(row[1])
            low, high = (time - 0.05) / (first + 0.05), (time + 0.05) / max(first - 0.05, 1e-9)
            assert low - 0.005 <= float(row[2][:-1]) <= high + 0.005, (row, rows[0])


@pytest.mark.parametrize("onednn_seconds, expected", [
    (0.5, "4096^3 float32 matmul, oneDNN; torch.mm 137.4"),
    (2.0, "4096^3 float32 matmul, torch.mm; oneDNN 68.7"),
])  # fmt: skip
def test_the_cpu_float32_peak_is_the_faster_librarys_and_names_both(monkeypatch, onednn_seconds, expected):
    def onednn_product():
        pass

    monkeypatch.setattr(peak, "_onednn_mm", lambda a, b: onednn_product)
    monkeypatch.setattr(peak, "_best_of_3", lambda product, device: onednn_seconds if product is onednn_product else 1)
    rate, what = peak.matmul_peak("cpu", torch.float32)
    assert (rate, what) == (2 * 4096**3 / min(onednn_seconds, 1), expected)
    monkeypatch.setattr(peak, "_onednn_mm", lambda a, b: None)  # a torch without it
    assert peak.matmul_peak("cpu", torch.float32) == (2 * 4096**3, "4096^3 float32 matmul")


def test_the_onednn_product_of_the_peak_is_float32s_product():
    a, b = torch.randn(96, 64), torch.randn(64, 80)
    product = peak._onednn_mm(a, b)
    if product is None:
        pytest.skip("this torch has no oneDNN linear")
    torch.testing.assert_close(product(), a @ b, rtol=1e-5, atol=1e-5)


def test_a_layers_flops_are_its_forward_and_backward_matmuls():
    """An Mlp 8 -> 16 -> 8 on 10 rows: each linear costs 2 * rows * in * out in the forward and twice that in the
    backward (the input's gradient and the weight's)."""
    flops = bench.count_flops(
        bench.Candidate("mlp", Mlp(8, 16)), torch.randn(10, 8, requires_grad=True), bench.Backend()
    )
    assert flops == 3 * 2 * 10 * (8 * 16 + 16 * 8)


def test_bad_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--batch-scale", "0"])
    assert "--batch-scale must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a median of no rounds after the tables' warm-up
        bench.main(["--quick", "--rounds", "0"])
    assert "--rounds must be a positive integer, got 0" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main(["--quick", "--device", "cuda"])
        assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_choices_set_for_a_run_are_in_its_header_and_a_bad_one_is_refused(capsys):
    bench.main(["--quick", "--rounds", "1", "--allocator", "system", "--tables", "dropout"])
    assert "kernel choices: as shipped;" in capsys.readouterr().out.splitlines()[0]
    bench.main(["--quick", "--rounds", "1", "--allocator", "system", "--tables", "dropout", "--choice", "ROW_BLOCK=32"])
    assert "kernel choices: ROW_BLOCK=32;" in capsys.readouterr().out.splitlines()[0]
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--tables", "dropout", "--choice", "AUTO_KERNELS[cpu,ragged]=bmm"])
    assert "--choice 'AUTO_KERNELS[cpu,ragged]=bmm': bmm needs equal groups" in capsys.readouterr().err
