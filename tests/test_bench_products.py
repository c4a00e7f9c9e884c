"""The layer benchmark's ``products`` table (moekit.analysis.bench_products): its products are the expert products the
soft and topk tables' layers run, its "one weight for all" column computes the same products on a bank whose experts
share one weight, and each row's figures follow from its times."""

import re

import pytest
import torch
from torch import nn

from moekit.analysis import bench_layers as bench
from moekit.analysis import bench_products as products
from moekit.moe import SoftMoE, TopKMoE
from moekit.moe import experts as experts_module

pytestmark = pytest.mark.usefixtures("one_thread_no_reexec")


def _calls_of(layer: nn.Module, x: torch.Tensor, monkeypatch) -> list[tuple[int, int, int, bool]]:
    """``(rows, in, out, ragged)`` of every grouped product ``layer``'s experts run on ``x``."""
    calls, real = [], experts_module.grouped_linear

    def spy(h, weight, bias, group_sizes, *args, **kwargs):
        calls.append((h.shape[0], weight.shape[1], weight.shape[2], isinstance(group_sizes, torch.Tensor)))
        return real(h, weight, bias, group_sizes, *args, **kwargs)

    monkeypatch.setattr(experts_module, "grouped_linear", spy)
    layer(x)
    monkeypatch.setattr(experts_module, "grouped_linear", real)
    return calls


def test_the_products_are_those_the_tables_layers_run(monkeypatch):
    (batch, tokens, dim, hidden, slots), soft_experts = products.SOFT_SHAPES[True]
    x = torch.randn(batch, tokens, dim)
    seen = []
    for experts in soft_experts:
        seen += _calls_of(SoftMoE(dim, hidden, num_experts=experts, slots_per_expert=slots // experts), x, monkeypatch)
    (tokens, dim), topk_experts = products.TOPK_SHAPES[True]
    x = torch.randn(1, tokens, dim)
    for experts, hidden in topk_experts:
        layer = TopKMoE(dim, hidden, num_experts=experts, top_k=2, gated=True, act_layer=nn.SiLU, bias=False)
        seen += _calls_of(layer, x, monkeypatch)
    expected = [(p.experts * p.rows, p.in_features, p.out_features, p.ragged) for p in products.layer_products(True)]
    assert seen == expected


@pytest.mark.parametrize("ragged", [True, False])
def test_one_weight_for_all_computes_the_products_of_copies_of_that_weight(ragged):
    p = products.Product("probe", experts=4, rows=6, in_features=8, out_features=5, ragged=ragged)
    shared = products._Grouped(p, shared=True, device=torch.device("cpu"))
    assert shared.weight.stride(0) == 0  # one [in, out] tensor's storage for every expert
    copies = products._Grouped(p, shared=False, device=torch.device("cpu"))
    with torch.no_grad():
        copies.weight.copy_(shared.weight)
    x = torch.randn(p.experts * p.rows, p.in_features)
    grad = torch.randn(p.experts * p.rows, p.out_features)
    outputs, grads = [], []
    for bank in (shared, copies):
        xx = x.clone().requires_grad_()
        y = bank(xx)
        y.backward(grad)
        outputs.append(y)
        grads.append((xx.grad, bank.weight.grad))
    torch.testing.assert_close(outputs[0], outputs[1])
    torch.testing.assert_close(grads[0][0], grads[1][0])
    # each expert's gradient apart, as for the bank of copies: the table writes them all in both columns
    assert grads[0][1].shape == (p.experts, p.in_features, p.out_features)
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_the_dense_product_is_one_matmul_of_all_the_rows():
    p = products.Product("probe", experts=3, rows=4, in_features=6, out_features=2, ragged=True)
    dense = products._Dense(p, torch.device("cpu"))
    x = torch.randn(p.experts * p.rows, p.in_features)
    torch.testing.assert_close(dense(x), x @ dense.weight.t())
    assert p.flops == 3 * 2 * 12 * 6 * 2  # forward, input gradient, weight gradient


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_quick_run_prints_one_row_per_product_whose_figures_follow_from_its_times(capsys, dtype):
    bench.main(["--quick", "--rounds", "1", "--allocator", "system", "--tables", "products", "--dtype", dtype])
    out = capsys.readouterr().out
    peak = float(re.search(r"matmul peak (\d+\.\d) GFLOP/s", out).group(1))
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ") and " ms, " in line]
    expected = products.layer_products(True)
    assert [row[0].strip() for row in rows] == [p.label for p in expected]
    for row, p in zip(rows, expected):
        assert row[1].strip() == f"{p.experts} x {p.rows}, {p.in_features} -> {p.out_features}"
        times = []
        for cell in row[2:5]:
            ms, rate, share = re.fullmatch(r" (\d+\.\d) ms, (\d+\.\d) \((\d+)%\) ", cell).groups()
            times.append(float(ms))
            # the rate is the product's FLOPs over the time (shown rounded to 0.1 ms), its share of the header's peak
            low, high = p.flops / (float(ms) + 0.05) / 1e6, p.flops / max(float(ms) - 0.05, 1e-3) / 1e6
            assert low - 0.05 <= float(rate) <= high + 0.05
            assert abs(float(rate) / peak * 100 - int(share)) <= 0.5 + 0.1 / peak * 100
        for cell, (num, den) in zip(row[5:7], ((times[0], times[1]), (times[1], times[2]))):
            ratio = float(cell.strip()[:-1])
            assert (num - 0.05) / (den + 0.05) - 0.005 <= ratio <= (num + 0.05) / max(den - 0.05, 1e-3) + 0.005
