"""The model benchmark (scripts/bench_models.py, moekit.analysis.bench_models): the timed step is the
training step of scripts/train.py, and a smoke run prints one table per group with a row
per model against the dense baseline."""

import json
import types

import pytest
import torch
import torch.nn.functional as F

from moekit.analysis import bench_models as bench
from moekit.analysis.bench_model_tables import print_table
from moekit.analysis.step_times import STEP_TIMES_KIND, load_step_times
from moekit.moe import collect_moe_outputs, moe_layers
from moekit.tasks.muon import MuonAdamW

pytestmark = pytest.mark.usefixtures("one_thread_no_reexec")


def test_timed_step_is_a_training_step():
    overrides = ["experiment=tokens_choice_vit", *bench.QUICK, "model.embed_dim=48", "moe.num_experts=4"]
    # bf16 on any CPU here (the experiment's "auto" would pick float32 without AMX): the step must run under it
    c = bench.build_candidate("top2", [*overrides, "trainer.precision=bf16-mixed"], batch_size=4)
    net = c.task.net
    # The composed config: the overrides reached the model, the experiment its trainer and optimizer.
    assert net.embed_dim == 48 and len(net.blocks) == 2
    layers = [layer for _, layer in moe_layers(net)]
    assert len(layers) == 1 and layers[0].experts.num_experts == 4 and layers[0].top_k == 2
    assert c.precision == "bf16-mixed" and c.clip_val == 1.0
    assert isinstance(c.optimizer, MuonAdamW)  # the ViT family's: Muon for the matrices, AdamW for the rest
    groups = [(g["algorithm"], g["weight_decay"]) for g in c.optimizer.param_groups]
    assert groups == [("muon", 0.05), ("muon", 0.05), ("adamw", 0.05), ("adamw", 0.0)]
    assert c.cfg.task.optimizer.lr == 4.0e-3 and all(g["lr"] == 0.0 for g in c.optimizer.param_groups)
    images, labels = c.batch
    assert images.shape == (4, 1, 28, 28) and labels.max() < 10 and c.examples_per_step == 4

    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    logits = []
    handle = net.register_forward_hook(lambda module, inputs, output: logits.append(output))
    timing, loss = bench.train_step(c)
    handle.remove()
    assert 0 < timing.update_seconds < timing.seconds and len(logits) == 1
    assert logits[0].dtype == torch.bfloat16  # the forward ran under bf16 autocast

    # The loss minimised = cross-entropy (with the experiment's label smoothing) + the MoE aux losses.
    ce = F.cross_entropy(logits[0].float(), labels, label_smoothing=0.1)
    aux = collect_moe_outputs(net).aux_loss.detach()
    assert aux > 0
    torch.testing.assert_close(loss - ce.detach(), aux)

    # Backward and the optimizer step ran: the optimizer's moments of the head, the router and the experts took their
    # gradients; at learning rate 0 no parameter moved (every step routes as the first); grads cleared.
    names = {p: name for name, p in net.named_parameters()}
    stepped = {names[p] for p, state in c.optimizer.state.items() if any(v.any() for v in state.values() if v.dim())}
    moe_prefix = next(name for name, _ in moe_layers(net))
    assert "head.weight" in stepped
    assert any(name.startswith(f"{moe_prefix}.experts.") for name in stepped)
    assert any(name.startswith(moe_prefix) and "expert" not in name for name in stepped)  # the router
    assert len(stepped) > 0.9 * len(before)
    assert all(torch.equal(p.detach(), before[name]) for name, p in net.named_parameters())
    assert all(p.grad is None for p in net.parameters())


def test_language_model_candidate():
    overrides = ["experiment=moe_transformer_lm", *bench.QUICK, "data.seq_len=32"]
    overrides.append("+moe.bias_update_rate=0.01")  # loss-free balancing
    c = bench.build_candidate("moe_transformer_lm", overrides, batch_size=3)
    input_ids, targets = c.batch
    assert input_ids.shape == targets.shape == (3, 32) and c.examples_per_step == 96
    assert torch.equal(input_ids[:, 1:], targets[:, :-1]) and int(targets.max()) < 256
    assert c.unit == "token" and c.summary.flops_per_token == c.flops_per_example > 0
    layers = [layer for _, layer in moe_layers(c.task.net)]
    assert len(layers) == 2 and all(layer.experts.num_experts == 8 for layer in layers)
    biases = [layer.router.expert_bias for layer in layers]
    assert all(bool((b == 0).all()) for b in biases)
    _, loss = bench.train_step(c)
    assert torch.isfinite(loss)
    # MoETask.optimizer_step's balancing update ran once: every bias moved by +-rate or 0.
    for b in biases:
        assert bool((b != 0).any()) and all(v == 0 or v == pytest.approx(0.01) for v in b.abs().tolist()), b


def _tables(text: str) -> dict[str, list[list[str]]]:
    """Title -> rows (cells) of every markdown table of the output."""
    tables = {}
    for chunk in text.split("\n### ")[1:]:
        title, *lines = chunk.splitlines()
        rows = [
            line.strip("|").split("|") for line in lines if line.startswith("| ") and not line.startswith("| model")
        ]
        tables[title] = [[cell.strip() for cell in row] for row in rows]
    return tables


def test_quick_run_prints_both_tables(capsys):
    bench.main(["--quick", "--rounds", "1", "--allocator", "system", "--override", "moe.num_experts=6"])
    out = capsys.readouterr().out
    assert out.startswith("# moekit model benchmark: torch ")
    tables = _tables(out)
    assert len(tables) == 2
    for group, (title, rows) in zip(bench.DEFAULT_GROUPS, tables.items(), strict=True):
        shared, models = bench.GROUPS[group]
        assert title.startswith(f"{group}: {' '.join([*shared, *bench.QUICK])}")
        assert [row[0] for row in rows] == list(models)
        assert rows[0][7] == "1.00x"  # the dense baseline
        assert all(len(row) == 8 and row[7].endswith("x") for row in rows)
        assert all(float(row[4]) > float(row[5]) > 0 for row in rows)  # the step, and its update within it
        assert rows[0][1] == rows[0][2]  # dense: every parameter is active
        assert all(row[1] != row[2] for row in rows[1:])  # MoE: more parameters than each token uses
    # The dense twins have no num_experts: the override is left out for them, and said so.
    assert "(dense: moe.num_experts=6 left out" in out
    assert "(dense_transformer_lm: moe.num_experts=6 left out" in out
    assert "(soft_moe:" not in out


def test_sweep_times_each_value_of_a_setting_against_one_dense_baseline(capsys):
    """A model without the swept key (top-1 has no slots) runs once: it stopped the sweep with Hydra's error."""
    bench.main(
        ["--quick", "--rounds", "1", "--allocator", "system", "--groups", "vit", "--models", "soft_moe", "top1"]
        + ["--sweep", "moe.slots_per_expert=1,2", "--override", "moe.capacity_factor=null"]
    )
    out = capsys.readouterr().out
    (rows,) = _tables(out).values()
    assert [row[0] for row in rows] == [
        "dense",
        "soft_moe slots_per_expert=1",
        "soft_moe slots_per_expert=2",
        "top1",
    ]
    assert rows[0][7] == "1.00x" and "(top1: no moe.slots_per_expert in its config, timed once)" in out
    # Twice the slots: the experts process twice the rows, so the forward FLOPs grow.
    flops = [float(row[3].rstrip("KMG")) for row in rows[1:]]
    assert flops[1] > flops[0]


def test_sweep_of_a_key_the_dense_twin_has_times_it_once_per_value_too(tmp_path, capsys):
    """``--sweep data.batch_size=4,6`` is for both models: the dense baseline runs once per value, first, each row
    ran its value (not --quick's batch), and each ratio is against the dense row of the same value."""
    out = tmp_path / "sweep.json"
    bench.main(
        ["--quick", "--rounds", "1", "--allocator", "system", "--groups", "vit", "--models", "soft_moe"]
        + ["--sweep", "data.batch_size=4,6", "--json", str(out)]
    )
    (printed,) = _tables(capsys.readouterr().out).values()
    names = ["dense batch_size=4", "dense batch_size=6", "soft_moe batch_size=4", "soft_moe batch_size=6"]
    assert [row[0] for row in printed] == names
    assert printed[0][7] == printed[1][7] == "1.00x"
    (table,) = json.loads(out.read_text())["tables"]
    rows = table["rows"]
    assert [row["batch_size"] for row in rows] == [4, 6, 4, 6]
    seconds = [row["seconds_per_step"] for row in rows]
    assert [row["vs_dense"] for row in rows] == [1.0, 1.0, seconds[2] / seconds[0], seconds[3] / seconds[1]]
    assert [f"{row['vs_dense']:.2f}x" for row in rows] == [row[7] for row in printed]


def test_an_override_no_model_of_the_group_has_is_refused(capsys):
    """A misspelt key is left out by every model: refused, not timed under a title that lists it as applied."""
    argv = ["--quick", "--rounds", "1", "--steps", "1", "--warmup", "0", "--allocator", "system", "--groups", "vit"]
    with pytest.raises(SystemExit, match=r"--override moe.num_expert=6: no model of group 'vit' has such a key"):
        bench.main([*argv, "--models", "soft_moe", "--override", "moe.num_expert=6", "moe.num_experts=6"])
    assert "### vit" not in capsys.readouterr().out  # no table


def test_time_models_times_consecutive_steps_after_warm_up(monkeypatch):
    """Each round gives every model its warm-up steps, then its timed steps, in a row; a model's time is
    the median over its timed steps of all rounds, the warm-up steps left out."""
    calls = []

    # Step i of a model takes i seconds (its update: a tenth of that): warm-up steps are the small ones.
    def fake_step(c):
        calls.append(c.name)
        i = calls.count(c.name)
        return bench.StepTiming(seconds=float(i), update_seconds=i / 10), None

    monkeypatch.setattr(bench, "train_step", fake_step)
    a, b = (types.SimpleNamespace(name=name) for name in "ab")
    times = bench.time_models([a, b], rounds=2, steps=3, warmup=2)
    assert "".join(calls) == "aaaaabbbbb" * 2
    # a's timed steps: 3, 4, 5 (round 1) and 8, 9, 10 (round 2): median 6.5.
    assert times == {name: bench.StepTiming(seconds=6.5, update_seconds=0.65) for name in "ab"}


def test_models_and_sweep_reject_bad_values():
    with pytest.raises(SystemExit, match="not a MoE model of group 'vit'"):
        bench.group_models("vit", ["dense"])
    assert bench.group_models("vit", ["experts_choice"]) == ["dense", "experts_choice"]
    with pytest.raises(SystemExit, match="write key=value1,value2"):
        bench.parse_sweep("moe.slots_per_expert")
    assert bench.parse_sweep("a.b=1, 2") == ("a.b", ["1", "2"])
    with pytest.raises(SystemExit, match="--steps=0 must be positive"):
        bench.main(["--quick", "--steps", "0", "--allocator", "system"])
    with pytest.raises(SystemExit, match="--warmup=-1 must be 0 or more"):
        bench.main(["--quick", "--warmup", "-1", "--allocator", "system"])


def test_json_holds_each_row_with_what_it_ran(tmp_path, capsys):
    """--json: the tables as printed, each row with its model's resolved config, batch size and precision,
    which plot_results.py --step-times matches to the runs of the same model."""
    out = tmp_path / "bench" / "scaling.json"
    bench.main(
        ["--quick", "--rounds", "1", "--allocator", "system", "--groups", "scaling"]
        + ["--models", "top1", "--sweep", "moe.num_experts=4,8", "--json", str(out)]
    )
    (printed,) = _tables(capsys.readouterr().out).values()
    record = json.loads(out.read_text())
    assert record["kind"] == STEP_TIMES_KIND and record["rounds"] == 1
    assert record["steps"] == 3 and record["warmup"] == 1  # the defaults
    (table,) = record["tables"]
    assert table["title"].startswith("scaling: results=scaling debug=tiny")
    rows = table["rows"]
    assert [row["name"] for row in rows] == [row[0] for row in printed]
    assert [row["name"] for row in rows] == [
        "dense",
        "top1 num_experts=4",
        "top1 num_experts=8",
    ]
    assert [f"{row['seconds_per_step'] * 1e3:.1f}" for row in rows] == [row[4] for row in printed]
    assert [f"{row['update_seconds'] * 1e3:.1f}" for row in rows] == [row[5] for row in printed]
    assert rows[0]["vs_dense"] == 1.0 and rows[0]["model_config"]["moe"]["name"] == "none"
    assert [row["model_config"]["moe"]["num_experts"] for row in rows[1:]] == [4, 8]
    assert all(
        row["model_config"]["moe"]["top_k"] == 1 == row["model_config"]["moe"]["capacity_factor"] for row in rows[1:]
    )
    assert all(row["batch_size"] == bench.QUICK_BATCH == row["examples_per_step"] for row in rows)
    assert all(row["precision"] == "32-true" for row in rows)  # debug=tiny's
    assert len(load_step_times([out])) == 3  # three different models


def test_s16_group_times_vit_s16_at_224_px_without_images(capsys):
    """The GPU table: ViT-S/16 against Soft MoE S/16 of the ImageNet experiment, built on a stand-in folder of
    empty class folders (no data.root needed), one row each."""
    bench.main(["--quick", "--rounds", "1", "--steps", "1", "--allocator", "system", "--groups", "s16"])
    ((title, rows),) = _tables(capsys.readouterr().out).items()
    assert title.startswith("s16: experiment=soft_moe_vit_s16_imagenet") and "images 3x224x224" in title
    assert [row[0] for row in rows] == ["vit_s16", "soft_moe_s16"]
    assert rows[0][1] == rows[0][2] and rows[1][1] != rows[1][2]  # dense, then MoE


def test_mfu_is_the_achieved_flops_over_the_peak_of_the_steps_precision(capsys):
    c = bench.build_candidate("dense", ["results=pareto", "moe=none", *bench.QUICK], batch_size=8)
    peak = {torch.bfloat16: 4e12, torch.float32: 1e12}
    print_table("t", [c], {c.name: bench.StepTiming(seconds=0.5, update_seconds=0.1)}, peak=peak)
    ((_, (row,)),) = _tables(capsys.readouterr().out).items()
    achieved = 3 * c.flops_per_example * c.examples_per_step / 0.5  # forward + backward: 3x the forward
    dtype = torch.bfloat16 if c.precision.startswith("bf16") else torch.float32
    assert float(row[8]) == pytest.approx(achieved / 1e12, abs=0.005)
    assert float(row[9].rstrip("%")) == pytest.approx(100 * achieved / peak[dtype], abs=0.05)
    (record,) = bench.table_record("t", [c], {c.name: bench.StepTiming(0.5, 0.1)}, peak=peak)["rows"]
    assert (record["achieved_flops_per_second"], record["mfu"]) == pytest.approx((achieved, achieved / peak[dtype]))


def test_a_compiled_table_says_when_dynamo_compiled_nothing(capsys, monkeypatch):
    """``--override task.compile=true``: the table says so when no frame was compiled (its steps ran eagerly, as with
    ``Module.compile`` on one torch 2.11 image), and stays quiet once the step ran compiled."""
    from torch._dynamo.utils import counters

    compile_fn = torch.compile  # aot_eager: quick to compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_fn(fn, **{"backend": "aot_eager", **kw}))
    c = bench.build_candidate("dense", ["results=pareto", "moe=none", *bench.QUICK, "task.compile=true"], batch_size=2)
    times = {c.name: bench.StepTiming(seconds=0.5, update_seconds=0.1)}
    torch._dynamo.reset()
    counters.clear()
    print_table("t", [c], times, peak=None)
    assert "Dynamo compiled no frame: the steps of dense ran eagerly" in capsys.readouterr().out
    bench.train_step(c)
    print_table("t", [c], times, peak=None)
    assert "compiled no frame" not in capsys.readouterr().out
