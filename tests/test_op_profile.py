"""Where a step's time goes (moekit.analysis.op_profile) and the benchmarks' --profile tables."""

import re

import pytest
import torch

from moekit.analysis import bench_layers, bench_models
from moekit.analysis.op_profile import top_operators

CPU = torch.device("cpu")


def test_the_top_operator_of_a_matmul_step_is_the_matmul():
    a = torch.randn(384, 384)

    def step():
        (a @ a).add_(1.0)

    ops = top_operators(step, CPU, steps=2, rows=3)
    assert len(ops) == 3 and ops[0].name == "aten::mm" and ops[0].share > 0.5
    assert [op.ms_per_step for op in ops] == sorted((op.ms_per_step for op in ops), reverse=True)
    assert ops[0].ms_per_step > 0 and sum(op.share for op in ops) <= 1 + 1e-9
    with pytest.raises(ValueError, match="steps=0"):
        top_operators(step, CPU, steps=0)


def _profile_tables(out: str) -> dict[str, list[list[str]]]:
    tables, title = {}, None
    for line in out.splitlines():
        if line.startswith("#### Where the time goes: "):
            title = line.removeprefix("#### Where the time goes: ")
            tables[title] = []
        elif line.startswith("### "):
            title = None
        elif title and line.startswith("| `"):
            tables[title].append([cell.strip() for cell in line.strip("|").split("|")])
    return tables


def test_the_layer_benchmark_profiles_each_moekit_layer(one_thread_no_reexec, capsys):
    bench_layers.main(["--quick", "--rounds", "1", "--allocator", "system", "--tables", "topk", "--profile"])
    tables = _profile_tables(capsys.readouterr().out)
    assert [title.split(" (")[0] for title in tables] == [
        "moekit TopKMoE, 8 experts of hidden 128",
        "moekit TopKMoE, 32 experts of hidden 32",
    ]
    for rows in tables.values():
        assert len(rows) == 8 and all(re.fullmatch(r"\d+\.\d\d", row[1]) and row[2].endswith("%") for row in rows)


def test_the_model_benchmark_profiles_each_model(one_thread_no_reexec, capsys):
    bench_models.main(["--quick", "--rounds", "1", "--allocator", "system", "--groups", "vit", "--models", "top2",
                       "--profile"])  # fmt: skip
    tables = _profile_tables(capsys.readouterr().out)
    assert [title.split(" (")[0] for title in tables] == ["dense, one training step", "top2, one training step"]
    assert all(len(rows) == 8 for rows in tables.values())
