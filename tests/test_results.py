"""Run records and the results tooling: ``results.json`` of real tiny runs, the results sweep configs
(``configs/experiment/results/``), aggregation over seeds, figures and the plot script."""

from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import moekit.models  # noqa: F401  (registers the models with timm)
from conftest import CONFIGS, compose_config, run_script, small_overrides
from moekit.analysis import bench_models
from moekit.analysis.aggregate import figure_kind, group_results, setting_label, summarize
from moekit.analysis.figures import plot_ablations, plot_all, plot_language, plot_pareto, plot_scaling
from moekit.analysis.records import (
    RECORD_VERSION,
    RESULTS_FILE,
    RunResult,
    archive_records,
    load_results,
    model_family,
    step_time_key,
)
from moekit.analysis.report import time_notes, write_report
from moekit.analysis.step_times import STEP_TIMES_KIND, attach_step_times, load_step_times
from moekit.analysis.tables import markdown_table, merge_markdown_tables
from moekit.callbacks import ThroughputMonitor
from moekit.commands.train import FOREIGN_WRITE_IDLE_S, _remove_stale_checkpoint_writes, train
from moekit.models.summary import lm_summary, model_summary
from moekit.moe import moe_layers
from moekit.utils.atomic import _TEMPORARY, atomic_write, remove_stale_temporaries, write_json_atomic
from moekit.utils.machine import machine_label

SWEEPS = sorted(p.stem for p in (CONFIGS / "results").glob("*.yaml"))
TINY = ["debug=tiny"]  # the tiny model of each family (configs/debug/models/)


def _read_record(output_dir: Path) -> dict:
    return json.loads((output_dir / RESULTS_FILE).read_text())


# ---------------------------------------------------------------------------------------------
# The run record of real runs


@pytest.fixture(scope="module")
def image_run(fake_fashion, tmp_path_factory):
    """One epoch of the tiny Soft MoE ViT on the fake Fashion-MNIST: (cfg, returned metrics, record)."""
    out = tmp_path_factory.mktemp("record_run")
    overrides = [*small_overrides(fake_fashion), "moe.num_experts=4", "seed=3"]
    cfg = compose_config("train", overrides, out)
    metrics = train(cfg)
    return cfg, metrics, _read_record(out), overrides, out


@pytest.mark.e2e
def test_the_record_names_the_run_and_its_network(image_run):
    cfg, _, record, overrides, out = image_run
    assert record["task_name"] == cfg.task_name == "train"
    assert record["seed"] == 3
    assert record["overrides"] == overrides
    assert record["model"]["name"] == "vit_tiny_patch4_28"
    assert record["model"]["family"] == "soft_moe"
    assert record["model"]["num_experts"] == 4
    # depth 2: one MoE block; the recipe's 0.653 slots per token: R(49 * 0.653 / 4 experts) = 8 slots each
    assert [layer["slots_per_expert"] for layer in record["model"]["moe_layers"]] == [8]
    assert record["config"]["model"]["embed_dim"] == 32
    assert not [p for p in out.iterdir() if p.name.startswith(f".{RESULTS_FILE}")], "no temporary file left"


@pytest.mark.e2e
def test_the_record_says_its_version_and_when_it_finished(image_run):
    """The version a reader checks, and the time that tells two records of one seed apart (the newer counts)."""
    _, _, record, _, out = image_run
    assert record["version"] == RECORD_VERSION
    assert record["kernel_choices"] == [], "the run used the kernel choice table as shipped"
    finished = datetime.fromisoformat(record["finished_at"]).timestamp()
    assert abs(finished - (out / RESULTS_FILE).stat().st_mtime) < 60
    (run,) = load_results(out)
    assert (run.finished_at, run.world_size) == (finished, 1)


def test_the_record_holds_each_layers_routing_settings_bpr_included():
    import timm

    from moekit.analysis.records import _moe_layer_settings

    net = timm.create_model("vit_tiny_patch4_28", moe={"recipe": "top2", "batch_priority": True}, moe_blocks="last_2")
    expected = {"layer": "top_k", "top_k": 2, "capacity_factor": 1.25, "eval_capacity_factor": 2.0}
    for entry in _moe_layer_settings(net):
        assert entry["batch_priority"] is True and expected.items() <= entry.items(), entry


@pytest.mark.e2e
def test_the_record_holds_the_model_summary_of_the_network(image_run):
    cfg, _, record, _, _ = image_run
    summary = model_summary(instantiate(cfg.model), input_size=(1, 28, 28))
    assert record["params"]["total"] == summary.total_params
    assert record["params"]["active_per_token"] == pytest.approx(summary.active_params_per_token)
    assert record["params"]["active_per_token"] < record["params"]["total"]
    assert record["flops"]["example"] == "image"
    assert record["flops"]["forward_per_example"] == pytest.approx(summary.flops_per_image)


@pytest.mark.e2e
def test_the_record_counts_examples_and_training_flops(image_run):
    _, _, record, _, _ = image_run
    training = record["training"]
    # 320 fake training images - 64 held out for validation = 256 = 8 batches of 32, one epoch
    assert training["examples_seen"] == 256
    assert training["batches"] == training["optimizer_steps"] == 8
    assert record["flops"]["training"] == pytest.approx(3 * record["flops"]["forward_per_example"] * 256)
    assert training["fit_seconds"] > 0
    # throughput and step time come from the same 7 timed batches of 32 (the first one starts the clock)
    assert training["mean_throughput"] * training["mean_batch_seconds"] == pytest.approx(32)
    assert training["mean_batch_seconds"] * 7 < training["fit_seconds"]


@pytest.mark.e2e
def test_the_record_holds_the_final_metrics_that_train_returns(image_run):
    _, metrics, record, _, _ = image_run
    test, val = record["metrics"]["test"], record["metrics"]["val"]
    assert test["acc"] == pytest.approx(metrics["test/acc"]) and test["acc_top5"] == pytest.approx(
        metrics["test/acc_top5"]
    )
    assert val["acc"] == pytest.approx(metrics["val/acc"])
    assert 0.0 <= test["acc"] <= test["acc_top5"] <= 1.0
    assert record["metrics"]["best_val"]["monitor"] == "val/acc"
    assert record["metrics"]["best_val"]["value"] == pytest.approx(metrics["val/acc"]), "one epoch: best = last"


@pytest.mark.e2e
def test_the_record_describes_the_machine(image_run):
    machine = image_run[2]["machine"]
    assert machine["torch"] == torch.__version__
    assert isinstance(machine["cpu"], str) and machine["cpu"]
    assert machine["cpu_cores"] >= machine["usable_cores"] >= 1
    assert (machine["gpu"] is None) == (not torch.cuda.is_available())


@pytest.mark.e2e
def test_a_language_model_record_counts_tokens(tmp_path):
    overrides = ["experiment=moe_transformer_lm", *TINY, "data.seq_len=32", "data.batch_size=4", "debug=fdr"]
    metrics = train(compose_config("train", overrides, tmp_path))
    record = _read_record(tmp_path)
    assert record["model"]["family"] == "transformer/top2"
    assert record["flops"]["example"] == "token"
    assert record["training"]["examples_seen"] == 4 * 32, "fast_dev_run: one batch of 4 sequences of 32 tokens"
    assert record["training"]["throughput_unit"] == "tokens/s"
    cfg = compose_config("train", overrides, tmp_path)
    expected = lm_summary(instantiate(cfg.model), seq_len=32).flops_per_token
    assert record["flops"]["forward_per_example"] == pytest.approx(expected)
    assert record["flops"]["training"] == pytest.approx(3 * expected * 128)
    assert record["metrics"]["test"]["ppl"] == pytest.approx(metrics["test/ppl"])
    assert record["metrics"]["test"]["bpb"] == pytest.approx(metrics["test/bpb"])


def test_throughput_monitor_counts_rows_or_elements():
    batch = (torch.zeros(4, 7), torch.zeros(4))
    assert ThroughputMonitor(count="rows").batch_examples(batch) == 4
    assert ThroughputMonitor(count="elements").batch_examples(batch) == 28
    with pytest.raises(ValueError, match="count='tokens'"):
        ThroughputMonitor(count="tokens")
    assert ThroughputMonitor().mean_throughput is None and ThroughputMonitor().mean_batch_seconds is None


def test_write_json_atomic_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / RESULTS_FILE
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    with pytest.raises(TypeError):
        write_json_atomic(path, {(1, 2): "a tuple key JSON cannot hold"})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == [RESULTS_FILE], "the temporary file is removed"


def test_stale_temporaries_of_interrupted_writes_are_removed_and_nothing_else(tmp_path):
    keep = ["last.ckpt", ".hidden.tmp", "notes.tmp", ".last.ckpt.short.tmp"]
    stale = [".last.ckpt.k3j9x0ab.tmp", ".epoch_001.ckpt.a_b1c2d3.tmp"]
    for name in keep + stale:
        (tmp_path / name).write_text("x")
    with atomic_write(tmp_path / "results.json") as file:  # the name atomic_write really gives its temporary
        assert _TEMPORARY.match(Path(file.name).name)
        file.write("{}")
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, "results.json"])
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_stale_temporaries_written_to_recently_are_kept_when_asked(tmp_path):
    """``idle_for``: a temporary written to within that many seconds is a write in progress (another live run's)."""
    live, dead = tmp_path / ".last.ckpt.k3j9x0ab.tmp", tmp_path / ".last.ckpt.z9y8x7w6.tmp"
    live.write_text("x")
    dead.write_text("x")
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    assert remove_stale_temporaries(tmp_path, idle_for=600) == [dead]
    assert live.exists()
    assert remove_stale_temporaries(tmp_path) == [live]


def test_a_run_branching_from_a_live_runs_checkpoint_leaves_its_write_in_progress(tmp_path):
    """A run started from another run's checkpoint (a fine-tune while that run trains on) removes every stale
    temporary of its own folder, but in the other run's folder only the ones no write touched for ten minutes."""
    other, own = tmp_path / "other" / "checkpoints", tmp_path / "run" / "checkpoints"
    for folder in (other, own):
        folder.mkdir(parents=True)
    (other / "last.ckpt").write_text("x")
    writing, dead = other / ".last.ckpt.k3j9x0ab.tmp", other / ".epoch_3.ckpt.z9y8x7w6.tmp"
    own_temp = own / ".last.ckpt.a1b2c3d4.tmp"
    for path in (writing, dead, own_temp):
        path.write_text("x")
    old = time.time() - FOREIGN_WRITE_IDLE_S - 60
    os.utime(dead, (old, old))
    _remove_stale_checkpoint_writes(tmp_path / "run", str(other / "last.ckpt"))
    assert writing.exists() and not dead.exists() and not own_temp.exists()
    # Resuming from its own folder (ckpt_path=<run>/checkpoints/last.ckpt): all of them, however recent.
    fresh = own / ".last.ckpt.e5f6g7h8.tmp"
    fresh.write_text("x")
    (own / "last.ckpt").write_text("x")
    _remove_stale_checkpoint_writes(tmp_path / "run", str(own / "last.ckpt"))
    assert not fresh.exists()


# ---------------------------------------------------------------------------------------------
# The results sweeps


def _sweep(name: str, tmp_path: Path, *overrides: str):
    return compose_config("train", [f"results={name}", *overrides], tmp_path)


def _params(cfg) -> dict[str, list[str]]:
    return {key: str(values).split(",") for key, values in cfg.hydra.sweeper.params.items()}


def test_the_results_sweeps_exist():
    assert SWEEPS == ["ablation_bpr", "ablation_l2norm", "ablation_slots", "language", "pareto", "scaling"]


@pytest.mark.parametrize("name", SWEEPS)
def test_each_sweep_composes_with_its_own_folder_and_three_seeds(name, tmp_path):
    cfg = _sweep(name, tmp_path)
    params = _params(cfg)
    assert params["seed"] == ["0", "1", "2"]
    assert cfg.task_name == f"results_{name}"
    expected_dir = f"results/ablations/{name.removeprefix('ablation_')}" if "ablation" in name else f"results/{name}"
    assert cfg.hydra.sweep.dir == f"{cfg.paths.log_dir}/{expected_dir}"
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.override_dirname}"
    assert "results" in cfg.hydra.job.config.override_dirname.exclude_keys
    assert figure_kind(cfg.task_name) == ("ablations" if "ablation" in name else name)
    for key, values in params.items():  # every value of every swept key composes
        for value in values:
            _sweep(name, tmp_path, f"{key}={value}")


def test_the_pareto_sweep_compares_five_routers_at_three_widths(tmp_path):
    params = _params(_sweep("pareto", tmp_path))
    assert params["model.embed_dim"] == ["64", "96", "128"]
    families = set()
    for moe in params["moe"]:
        cfg = _sweep("pareto", tmp_path, f"moe={moe}", "model.embed_dim=64")
        assert cfg.trainer.max_epochs == 5 and cfg.data.batch_size == 256, "the same budget for every model"
        net = instantiate(cfg.model)
        assert net.embed_dim == 64
        families.add(model_family(net))
    assert families == {"dense", "soft_moe", "top1", "top2", "experts_choice"}


@pytest.mark.parametrize("num_experts", [8, 256])
def test_the_scaling_sweep_keeps_slots_and_capacity_fixed(num_experts, tmp_path):
    params = _params(_sweep("scaling", tmp_path))
    assert params["moe.num_experts"] == ["8", "16", "32", "64", "128", "256"]
    for moe in params["moe"]:
        cfg = _sweep("scaling", tmp_path, f"moe={moe}", f"moe.num_experts={num_experts}", "model.embed_dim=32")
        layers = [layer for _, layer in moe_layers(instantiate(cfg.model))]
        assert len(layers) == 2, "MoE in the last two blocks"
        for layer in layers:
            assert layer.experts.num_experts == num_experts
            if hasattr(layer, "num_slots"):
                assert layer.num_slots == 256
            else:
                assert layer.capacity_factor == layer.eval_capacity_factor == 1.0


def test_the_scaling_sweeps_dense_reference_trains_the_dense_twin_on_the_same_budget(tmp_path):
    # python scripts/train.py -m results=scaling moe=none seed=0,1,2 hydra.sweeper.params=null
    moe = _sweep("scaling", tmp_path, "moe=results/scaling_soft_moe")
    dense = _sweep("scaling", tmp_path, "moe=none", "hydra.sweeper.params=null")
    assert dense.hydra.sweeper.params is None, "only the command line's seeds are swept"
    assert model_family(instantiate(dense.model)) == "dense"
    for key in ("task_name", "data", "trainer", "task", "hydra.sweep.dir"):
        assert OmegaConf.select(dense, key) == OmegaConf.select(moe, key), f"{key}: the same as the MoE runs"
    dense_model, moe_model = (OmegaConf.to_container(c.model, resolve=True) for c in (dense, moe))
    assert dense_model.pop("moe")["name"] == "none" and moe_model.pop("moe")["name"] == "soft_moe"
    assert dense_model == moe_model, "the same network but its MoE layers"


def test_the_language_sweep_compares_models_at_equal_forward_flops(tmp_path):
    params = _params(_sweep("language", tmp_path))
    flops = {}
    for experiment in params["experiment"]:
        cfg = _sweep("language", tmp_path, f"experiment={experiment}")
        assert cfg.task_name == "results_language" and cfg.trainer.max_epochs == 8, "the sweep's budget wins"
        flops[experiment] = lm_summary(instantiate(cfg.model), seq_len=cfg.data.seq_len).flops_per_token
    assert len(flops) == 6, "three families at two sizes"
    for name, value in flops.items():  # each model matches the dense Transformer of its size
        reference = flops["results/dense_transformer_lm_small" if name.endswith("_small") else "dense_transformer_lm"]
        assert abs(value / reference - 1) < 0.02, flops
    assert flops["dense_transformer_lm"] > 3 * flops["results/dense_transformer_lm_small"], "two distinct sizes"


def test_the_bpr_ablation_sweeps_bpr_at_a_low_capacity(tmp_path):
    params = _params(_sweep("ablation_bpr", tmp_path))
    assert params["moe.batch_priority"] == ["true", "false"]
    assert min(float(c) for c in params["moe.capacity_factor"]) < 1.0
    cfg = _sweep("ablation_bpr", tmp_path, "moe.capacity_factor=0.5", "moe.batch_priority=true")
    layer = next(layer for _, layer in moe_layers(instantiate(cfg.model)))
    assert layer.capacity_factor == layer.eval_capacity_factor == 0.5 and layer.top_k == 2


def _first_member(name: str, fake_fashion: Path) -> list[str]:
    """The overrides of a sweep's first member, made tiny and fast."""
    if name == "language":
        return [*TINY, "data.seq_len=32", "data.batch_size=4"]
    return [f"data.root={fake_fashion}", "data.val_size=64", "data.batch_size=16", *TINY]


@pytest.mark.parametrize("name", SWEEPS)
@pytest.mark.e2e
def test_fast_dev_run_of_one_member_of_each_sweep(name, fake_fashion, tmp_path):
    first = {key: values[0] for key, values in _params(_sweep(name, tmp_path)).items()}
    overrides = [f"{k}={v}" for k, v in first.items()] + _first_member(name, fake_fashion)
    cfg = _sweep(name, tmp_path, *overrides, "trainer.fast_dev_run=true", "logger=csv")
    metrics = train(cfg)
    record = _read_record(tmp_path)
    assert record["task_name"] == f"results_{name}"
    assert record["seed"] == 0
    metric = "test/ppl" if name == "language" else "test/acc"
    assert math.isfinite(metrics[metric])
    result = RunResult.from_record(record, tmp_path)
    assert result.training_flops and result.training_flops > 0
    if name in BENCH_GROUP:  # bench_models.py times this model: its row matches the run's step key
        candidate = bench_models.build_candidate("first", [f"results={name}", *overrides])
        _write_step_times(
            tmp_path / "steps.json",
            [bench_models.table_record("t", [candidate], {candidate.name: bench_models.StepTiming(0.25, 0.1)})],
        )
        (timed,) = attach_step_times([result], load_step_times([tmp_path / "steps.json"]))
        assert timed.bench_step_seconds == 0.25
        assert timed.bench_seconds == pytest.approx(0.25 * result.examples_seen / candidate.examples_per_step)


BENCH_GROUP = {"pareto": "vit", "scaling": "scaling", "language": "lm"}  # sweep -> group of bench_models.py


def _write_step_times(path: Path, tables: list[dict]) -> Path:
    """A step-time file as ``bench_models.py --json`` writes it (the fields the results tooling reads)."""
    return write_json_atomic(path, {"kind": STEP_TIMES_KIND, "version": 1, "tables": tables})


@pytest.mark.e2e
def test_a_sweep_from_the_command_line_then_its_figures(fake_fashion, tmp_path):
    """`-m results=ablation_slots` with the seeds and slots narrowed on the command line (it wins over the
    sweep's lists): one folder per run under logs/results/ablations/slots, then the plot script draws the
    ablation figure and the table from them."""
    run = run_script(
        "train.py",
        "-m",
        "results=ablation_slots",
        "moe.slots_per_expert=1,2",
        "seed=0",
        f"paths.log_dir={tmp_path / 'logs'}",
        f"data.root={fake_fashion}",
        "data.val_size=64",
        "data.batch_size=16",
        *TINY,
        "trainer.fast_dev_run=true",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sweep = tmp_path / "logs" / "results" / "ablations" / "slots"
    runs = sorted(p.parent.name for p in sweep.glob(f"*/{RESULTS_FILE}"))
    assert len(runs) == 2
    assert all("seed=0" in r and "results=" not in r and "data.root" not in r for r in runs)
    plot = run_script("plot_results.py", str(tmp_path / "logs" / "results"), cwd=tmp_path)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert "`moe.slots_per_expert=1`" in plot.stdout
    figure = tmp_path / "logs" / "results" / "figures" / "ablations.png"
    assert figure.read_bytes().startswith(b"\x89PNG")
    assert (figure.parent / "results.md").read_text() in plot.stdout


# ---------------------------------------------------------------------------------------------
# Aggregation, tables and figures from hand-made records


def _record(task: str, family: str, seed: int, overrides: list[str], **values) -> dict:
    """A run record with the fields the results tooling reads."""
    lm = values.get("ppl") is not None
    forward = values.get("forward", 1e6)
    return {
        "version": 1,
        "task_name": task,
        "seed": seed,
        "overrides": [*overrides, f"seed={seed}"],
        "model": {"family": family, "num_experts": values.get("experts", 0)},
        "params": {"total": values.get("params", 1000), "active_per_token": values.get("active", 500.0)},
        "flops": {"forward_per_example": forward, "training": 3 * forward * 1000},
        "training": {
            "examples_seen": values.get("examples", 1000),
            "fit_seconds": values.get("seconds", 10.0),
            "mean_batch_seconds": values.get("step", 0.1),
            "mean_throughput": 100.0,
        },
        "metrics": {"val": {}, "test": {"ppl": values["ppl"], "bpb": 1.0} if lm else {"acc": values["acc"]}},
        "config": {
            "model": values.get("model_config", {"name": overrides}),
            "data": {"batch_size": values.get("batch_size", 100)},
            "trainer": {"precision": "bf16-mixed"},
        },
    }


def _results(records: list[dict], root: Path | None = None) -> list[RunResult]:
    return [RunResult.from_record(r, root or Path(f"run{i}")) for i, r in enumerate(records)]


PARETO = [
    _record("results_pareto", family, seed, [f"model={model}", f"model.embed_dim={width}"], **values)
    for family, model in (("dense", "dense_vit"), ("soft_moe", "soft_moe_vit"))
    for width in (64, 128)
    for seed, values in enumerate(
        dict(acc=a, forward=width * 1e4, seconds=width + s) for a, s in ((0.80, 1), (0.90, 2), (0.85, 6))
    )
]
SCALING = [
    _record("results_scaling", family, seed, [f"model={model}", f"model.num_experts={e}"], acc=0.8, experts=e, step=e)
    for family, model in (("soft_moe", "results/scaling_soft_moe"), ("top1", "results/scaling_top1"))
    for e in (8, 64, 256)
    for seed in (0, 1)
]
LANGUAGE = [
    _record("results_language", family, seed, [f"model={family}"], ppl=3.0 + seed, forward=9e6)
    for family in ("transformer/dense", "transformer/top2", "lstm/top4")
    for seed in (0, 1, 2)
]
ABLATIONS = [
    _record(task, "soft_moe", seed, [f"{key}={value}"], acc=0.8 + 0.01 * seed)
    for task, key, values in (
        ("results_ablation_l2norm", "model.moe_kwargs.normalize", ("true", "false")),
        ("results_ablation_slots", "model.moe_kwargs.slots_per_expert", ("1", "2", "4")),
    )
    for value in values
    for seed in (0, 1, 2)
]


def test_summarize_gives_mean_median_min_max_and_sample_std():
    stat = summarize([0.8, None, 0.9, 0.85])
    assert (stat.mean, stat.median, stat.low, stat.high, stat.n) == (pytest.approx(0.85), 0.85, 0.8, 0.9, 3)
    assert stat.std == pytest.approx(0.05)
    times = summarize([300.0, 1356.0, 290.0])  # one run beside other work
    assert (times.center(), times.center(median=True)) == (pytest.approx(648.667, abs=1e-3), 300.0)
    assert summarize([0.7]).std == 0.0
    assert summarize([None]) is None


def test_group_results_averages_seeds_of_one_configuration():
    groups = group_results(_results(PARETO))
    assert len(groups) == 4, "2 families x 2 widths"
    assert all(g.seeds == [0, 1, 2] for g in groups)
    acc = groups[0].stat(lambda r: r.test["acc"])
    assert (acc.mean, acc.low, acc.high) == (pytest.approx(0.85), 0.80, 0.90)
    seconds = groups[0].stat(lambda r: r.fit_seconds)
    assert seconds.low < seconds.mean < seconds.high
    assert {setting_label(g, groups) for g in groups} == {
        f"model={m},model.embed_dim={w}" for m in ("dense_vit", "soft_moe_vit") for w in (64, 128)
    }


def test_group_results_orders_numbers_by_value():
    groups = group_results(_results(SCALING))  # lexically "256" < "64" < "8"
    experts = [(g.family, dict(g.setting)["model.num_experts"]) for g in groups]
    assert experts == [(f, e) for f in ("soft_moe", "top1") for e in ("8", "64", "256")]


def test_group_results_keeps_tasks_apart():
    same_overrides = [_record(task, "soft_moe", 0, ["model.x=1"], acc=0.5) for task in ("results_a", "results_b")]
    assert len(group_results(_results(same_overrides))) == 2


def test_setting_label_shows_only_what_varies_and_drops_the_results_folder():
    groups = group_results(_results(SCALING))
    labels = {setting_label(g, groups) for g in groups}
    assert "model=scaling_top1,model.num_experts=256" in labels
    one = group_results(_results([_record("results_x", "dense", 0, ["data.root=/d"], acc=0.5)]))
    assert setting_label(one[0], one) == "-"


def test_markdown_table_rows_read_mean_and_min_max():
    table = markdown_table(_results(PARETO + LANGUAGE))
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 4 + 3 + 2, "7 configurations, then the 2 Soft MoE ones against dense of their width"
    assert "85.00 (80.00-90.00)" in table, "accuracy in % over the 3 seeds"
    assert "4.00 (3.00-5.00)" in table, "perplexity over the 3 seeds"
    assert "| 66 (65-70) |" in table, "fit time: the median of 65, 66 and 70 s (mean 67)"
    blocks = {block.split(" ", 1)[0]: block for block in table.split("#### ")[1:]}
    assert "test top-1 %" in blocks["results_pareto"] and "test ppl" not in blocks["results_pareto"]
    assert "test ppl" in blocks["results_language"] and "test top-1 %" not in blocks["results_language"]
    for table_text in table.split("\n\n"):
        widths = {line.count("|") for line in table_text.splitlines() if line.startswith("|")}
        assert len(widths) <= 1, "every row has as many cells as the header"


def test_the_scaling_table_reads_slopes_per_doubling_and_differences_to_dense_of_the_same_seed():
    """Seed 0 gains 3 points from 8 to 64 experts (3 doublings: +1.00 a doubling), seed 1 none (+0.00);
    against the dense run of its own seed the four runs are 0, +3, 0, 0 points: mean +0.75, one above."""
    records = [
        _record("results_scaling", "dense", seed, ["model=dense_vit"], acc=acc) for seed, acc in ((0, 0.80), (1, 0.82))
    ] + [
        _record(
            "results_scaling",
            "soft_moe",
            seed,
            ["model=results/scaling_soft_moe", f"model.num_experts={e}"],
            acc=acc,
            experts=e,
        )
        for seed, e, acc in ((0, 8, 0.80), (0, 64, 0.83), (1, 8, 0.82), (1, 64, 0.82))
    ]
    table = markdown_table(_results(records))
    assert "| soft_moe | 0,1 | +0.50 (+1.00, +0.00) | +0.75 (+0.00 to +3.00) | 1 of 4 |" in table
    assert "| dense |" not in table.split("Trends against the number of experts:")[1]


def test_the_pareto_table_pairs_each_moe_with_the_dense_run_of_its_width_and_seed():
    """Width 64: Soft MoE at 0.9x the dense FLOPs, fit times 110/100 and 180/200 s (ratios 1.1 and 0.9,
    median 1.00x), accuracy +1.0 and -0.5 points against dense seed 0 and 1 (mean +0.25, one above).
    Width 128 has no dense run, so its MoE gets no row rather than a comparison with another width."""
    records = [
        _record(
            "results_pareto", "dense", seed, ["model=dense_vit", "model.embed_dim=64"], acc=acc, forward=10.0, seconds=s
        )
        for seed, acc, s in ((0, 0.80, 100.0), (1, 0.82, 200.0))
    ] + [
        _record(
            "results_pareto",
            "soft_moe",
            seed,
            ["model=soft_moe_vit", f"model.embed_dim={w}"],
            acc=acc,
            forward=9.0,
            seconds=s,
        )
        for w, seed, acc, s in ((64, 0, 0.81, 110.0), (64, 1, 0.815, 180.0), (128, 0, 0.9, 50.0))
    ]
    pairs = markdown_table(_results(records)).split("Against the dense run of the same width and seed:")[1]
    assert "| `model=soft_moe_vit,model.embed_dim=64` | 0,1 | 0.90x | 1.00x | +0.25 (+1.00, -0.50) | 1 of 2 |" in pairs
    assert "embed_dim=128" not in pairs and "dense_vit" not in pairs
    assert "Against the dense run" not in markdown_table(_results(records[2:])), "no dense run: no pairs"


@pytest.mark.e2e
def test_the_table_says_which_machines_a_sweeps_runs_ran_on_and_the_plot_script_warns_when_they_differ(tmp_path):
    """Seeds from two sessions on two CPUs: the table names both machines with their run counts, and the
    plot script says the recorded times of that sweep cannot be compared (none for a one-machine sweep)."""
    xeon = {"cpu": "Intel Xeon", "torch_threads": 2, "gpu": None}
    epyc = {"cpu": "AMD EPYC", "torch_threads": 1, "gpu": None}
    records = [dict(r, machine=xeon if r["seed"] == 0 else epyc) for r in SCALING] + [
        dict(r, machine=epyc) for r in LANGUAGE
    ]
    table = markdown_table(_results(records))
    assert "Ran on: Intel Xeon, 2 torch threads (6 runs); AMD EPYC, 1 torch thread (6 runs)" in table
    assert "Ran on: AMD EPYC, 1 torch thread (9 runs)" in table
    for i, record in enumerate(records):
        (tmp_path / "runs" / f"run{i}").mkdir(parents=True)
        write_json_atomic(tmp_path / "runs" / f"run{i}" / RESULTS_FILE, record)
    plot = run_script("plot_results.py", str(tmp_path / "runs"), cwd=tmp_path)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert "note: the runs of results_scaling ran on 2 machines (AMD EPYC, 1 torch thread; Intel Xeon" in plot.stderr
    assert "results_language ran on" not in plot.stderr
    gpu = machine_label({"cpu": "AMD EPYC", "torch_threads": 16, "gpu": "NVIDIA H100", "gpu_count": 1})
    assert gpu == "AMD EPYC, 16 torch threads, NVIDIA H100 x1"


def test_figure_kind_of_each_sweep_task():
    assert [figure_kind(t) for t in ("results_pareto", "results_scaling", "results_language")] == [
        "pareto",
        "scaling",
        "language",
    ]
    assert figure_kind("results_ablation_bpr") == "ablations"
    assert figure_kind("soft_moe_vit") is None and figure_kind("results_other") is None


@pytest.mark.parametrize(
    "plot, records",
    [(plot_pareto, PARETO), (plot_scaling, SCALING), (plot_language, LANGUAGE), (plot_ablations, ABLATIONS)],
)
def test_each_figure_is_a_png(plot, records, tmp_path):
    out = plot(_results(records), tmp_path / "figure.png")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_log_axes_read_in_short_plain_numbers(tmp_path, monkeypatch):
    import moekit.analysis.figures as results

    labels = {}

    def keep(fig, out, **_):  # the x tick labels of each panel, as drawn
        fig.canvas.draw()
        labels[out.name] = [
            {
                label.get_text()
                for minor in (False, True)
                for loc, label in zip(ax.get_xticks(minor=minor), ax.get_xticklabels(minor=minor), strict=True)
                if min(ax.get_xlim()) <= loc <= max(ax.get_xlim()) and label.get_text()
            }
            for ax in fig.axes
        ]
        results.pyplot().close(fig)
        return out

    monkeypatch.setattr(results, "_save", keep)
    wide = [
        _record("results_pareto", "dense", 0, [f"model.embed_dim={w}"], acc=0.8, forward=f, seconds=s)
        for w, f, s in ((64, 8e9, 280.0), (128, 5e10, 1300.0))
    ]  # 24T and 150T training FLOPs
    plot_pareto(_results(wide), tmp_path / "pareto.png")
    flops, seconds = labels["pareto.png"]
    assert {"30T", "50T", "100T"} <= flops and "200T" not in flops, "2, 3 and 5 x 10^n inside the axis"
    assert {"300", "500", "1000"} <= seconds
    assert not any("$" in label or "e+" in label for label in flops | seconds), "no 10^n mathtext"
    plot_scaling(_results(SCALING), tmp_path / "scaling.png")
    assert {"8", "64", "256"} <= labels["scaling.png"][0]


def test_plot_all_draws_one_figure_per_sweep_kind(tmp_path):
    other = [_record("soft_moe_vit", "soft_moe", 0, [], acc=0.9)]
    written = plot_all(_results(PARETO + ABLATIONS + other), tmp_path)
    assert sorted(p.name for p in written) == ["ablations.png", "pareto.png"]


def test_load_results_reads_every_record_below_a_folder(tmp_path):
    for i, record in enumerate(LANGUAGE):
        folder = tmp_path / f"model=m{i % 3}" / f"seed={i}"
        folder.mkdir(parents=True)
        write_json_atomic(folder / RESULTS_FILE, record)
    results = load_results(tmp_path)
    assert len(results) == len(LANGUAGE)
    assert {r.family for r in results} == {"transformer/dense", "transformer/top2", "lstm/top4"}


def test_load_results_says_clearly_when_there_is_nothing_to_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results.json under"):
        load_results(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_results(tmp_path / "missing")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RESULTS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="run/results.json"):
        load_results(tmp_path)


def _write_records(root: Path, named: dict[str, dict]) -> dict[str, Path]:
    """Each record in its own run folder under ``root``, by folder name; the ``results.json`` files by name."""
    files = {}
    for name, record in named.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        files[name] = write_json_atomic(root / name / RESULTS_FILE, record)
    return files


def test_a_record_of_a_newer_version_or_without_a_field_every_record_has_is_refused(tmp_path):
    """A record written by a newer moekit (a version above RECORD_VERSION) is refused, naming the file, its version,
    the versions this moekit reads and the fix; version 1 (every record so far) is read. A record without its version,
    its task or its family, or with an impossible world size, is refused rather than tabulated as a task "None"."""
    assert RECORD_VERSION == 1, "a new version: add the versions this moekit still reads to these tests"
    good = _write_records(tmp_path / "good", {"seed=0": LANGUAGE[0]})["seed=0"]
    assert [r.task_name for r in load_results(good.parent.parent)] == ["results_language"]
    newer = _write_records(tmp_path / "newer", {"seed=0": LANGUAGE[0], "seed=1": dict(LANGUAGE[1], version=2)})
    with pytest.raises(ValueError, match="upgrade moekit") as error:
        load_results(tmp_path / "newer")
    message = str(error.value)
    assert f"'{newer['seed=1']}' is a run record of version 2, written by a newer moekit" in message
    assert (
        "this moekit reads versions 1 to 1" in message and f"move its run folder '{newer['seed=1'].parent}'" in message
    )
    with pytest.raises(ValueError, match="written by a newer moekit"):
        archive_records(tmp_path / "newer", tmp_path / "archive")
    assert not (tmp_path / "archive").exists()
    broken = {
        "no 'version', which every run record": {k: v for k, v in LANGUAGE[0].items() if k != "version"},
        "version '1', which no moekit writes": dict(LANGUAGE[0], version="1"),
        "no 'task_name', where every version-1 run record has a string": dict(LANGUAGE[0], task_name=None),
        "no 'model.family'": dict(LANGUAGE[0], model={"num_experts": 0}),
        "0 as its 'training.world_size'": dict(LANGUAGE[0], training={"world_size": 0}),
        "finished_at 'yesterday', not an ISO 8601 time": dict(LANGUAGE[0], finished_at="yesterday"),
    }
    for i, (expected, record) in enumerate(broken.items()):
        file = _write_records(tmp_path / f"broken{i}", {"run": record})["run"]
        with pytest.raises(ValueError, match="move its run folder|correct or delete") as error:
            load_results(file.parent.parent)
        assert str(error.value).startswith(f"'{file}' has {expected}"), str(error.value)


def test_a_run_recorded_twice_counts_once_as_its_newest_record(tmp_path):
    """Seed 1 of a setting run again into another folder (or its folder copied): one seed, not two. The newest record
    counts, by its finished_at, else (records from before finished_at) by its file's time; a record with finished_at
    is newer than one without. The table counts 3 runs and names the record left out; seeds of a sweep still pool."""
    seeds = {f"seed={s}": dict(r, finished_at="2026-01-01T00:00:00+00:00") for s, r in enumerate(PARETO[:3])}
    rerun = dict(PARETO[1], finished_at="2026-01-02T00:00:00+00:00", metrics={"val": {}, "test": {"acc": 0.7}})
    files = _write_records(tmp_path / "sweep", {**seeds, "rerun/seed=1": rerun})
    os.utime(files["seed=1"], (time.time() + 60,) * 2)  # a later file time: finished_at decides
    runs = load_results(tmp_path / "sweep")
    (group,) = group_results(runs)
    assert group.seeds == [0, 1, 2]
    accuracy = group.stat(lambda r: r.test["acc"])
    assert (accuracy.n, accuracy.mean, accuracy.low) == (3, pytest.approx((0.80 + 0.70 + 0.85) / 3), 0.70)
    table = markdown_table(runs)
    assert "#### results_pareto (1 configurations, 3 runs)" in table
    assert "Left out: 1 older record(s) of a run made again with the same setting and seed" in table
    assert f"`{files['seed=1'].parent}` (kept: `{files['rerun/seed=1'].parent}`)" in table
    assert "Left out" not in markdown_table(_results(PARETO)), "different seeds of one setting: no repeats"
    # Records without finished_at: the newer file; one with finished_at beats one without.
    old = {name: {k: v for k, v in record.items() if k != "finished_at"} for name, record in seeds.items()}
    files = _write_records(tmp_path / "old", {**old, "copy/seed=1": dict(old["seed=1"], metrics=rerun["metrics"])})
    os.utime(files["seed=1"], (time.time() - 60,) * 2)
    (group,) = group_results(load_results(tmp_path / "old"))
    assert group.seeds == [0, 1, 2] and group.stat(lambda r: r.test["acc"]).low == 0.70
    _write_records(tmp_path / "old", {"seed=1": dict(old["seed=1"], finished_at="2025-01-01T00:00:00Z")})
    (group,) = group_results(load_results(tmp_path / "old"))
    assert group.seeds == [0, 1, 2] and group.stat(lambda r: r.test["acc"]).low == 0.80
    unseeded = [dict(r, seed=None, overrides=["model=dense_vit", "model.embed_dim=64"]) for r in PARETO[:3]]
    assert group_results(_results(unseeded))[0].stat(lambda r: r.test["acc"]).n == 3, "no seed: each its own draw"


def test_the_time_notes_count_a_run_made_twice_once():
    """Seed 1 first made on another CPU, then again on the sweep's: its newer record is the one the table and the
    figure use, so the sweep's times all come from one CPU (no note that they are not comparable), and each seed
    lacks a step time once. Made again on the other CPU instead, its times do differ."""
    xeon = {"cpu": "Intel Xeon", "torch_threads": 2, "gpu": None}
    epyc = {"cpu": "AMD EPYC", "torch_threads": 2, "gpu": None}
    seeds = [dict(r, machine=xeon, finished_at="2026-01-02T00:00:00+00:00") for r in PARETO[:3]]
    first = dict(seeds[1], machine=epyc, finished_at="2026-01-01T00:00:00+00:00")
    assert time_notes(_results([first, *seeds]), step_times_given=False) == []
    (note,) = time_notes(_results([first, *seeds]), step_times_given=True)
    assert note.startswith("3 run(s) of results_pareto have no step time")
    rerun = dict(first, finished_at="2026-01-03T00:00:00+00:00")
    (note,) = time_notes(_results([*seeds, rerun]), step_times_given=False)
    assert note.startswith("the runs of results_pareto ran on 2 machines")


def test_the_report_counts_a_run_made_twice_once(tmp_path):
    """plot_results.py said "(4 runs)" of three seeds, one recorded twice, while its table counted 3."""
    seeds = [dict(r, finished_at="2026-01-02T00:00:00+00:00") for r in PARETO[:3]]
    first = dict(seeds[1], finished_at="2026-01-01T00:00:00+00:00")
    assert write_report(_results([first, *seeds]), tmp_path).runs == 3


def test_the_benchmarked_time_of_a_multi_process_run_counts_each_process_steps(tmp_path):
    """4 processes, batches of 100 each, 4000 examples in all: 10 steps side by side, not 40. At a benchmarked step
    of 0.5 s (one process's batch of 100) the run's time is 5 s; one process with the same examples takes 20 s."""
    ddp = dict(PARETO[0], training=dict(PARETO[0]["training"], examples_seen=4000, world_size=4))
    single = dict(PARETO[1], training=dict(PARETO[1]["training"], examples_seen=4000, world_size=1))
    _write_records(tmp_path / "runs", {"ddp": ddp, "single": single})
    rows = [_step_row({"name": ["model=dense_vit", "model.embed_dim=64"]}, 0.5)]
    step_times = load_step_times([_write_step_times(tmp_path / "steps.json", [{"title": "t", "rows": rows}])])
    timed = attach_step_times(load_results(tmp_path / "runs"), step_times)
    assert [(r.path.name, r.bench_seconds) for r in timed] == [("ddp", pytest.approx(5.0)), ("single", 20.0)]


@pytest.mark.e2e
def test_plot_script_on_an_empty_folder_fails_with_one_line(tmp_path):
    run = run_script("plot_results.py", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 1
    assert "no results.json under" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.e2e
def test_plot_script_refuses_a_file_as_its_out_folder_before_writing(tmp_path):
    (tmp_path / "runs" / "run0").mkdir(parents=True)
    write_json_atomic(tmp_path / "runs" / "run0" / RESULTS_FILE, SCALING[0])
    (tmp_path / "figures").write_text("a file")
    run = run_script("plot_results.py", str(tmp_path / "runs"), "--out", str(tmp_path / "figures"), cwd=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"--out '{tmp_path / 'figures'}' is a file; give a folder" in run.stderr
    assert (tmp_path / "figures").read_text() == "a file"


def test_reading_and_plotting_run_records_imports_no_torch():
    """plot_results.py starts in a fraction of a second: the modules that read, tabulate and plot records leave
    torch (and the models, timm, Lightning) unimported until a record is written."""
    import subprocess
    import sys

    code = (
        "import sys, moekit.analysis.report, moekit.analysis.step_times, moekit.analysis.records, "
        "moekit.utils.machine; print(sorted(m for m in ('torch', 'timm', 'lightning') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def _write_sweep(root: Path, records: list[dict]) -> list[Path]:
    """Each record in its own run folder, named by its overrides as Hydra's sweep subdir names it,
    beside a checkpoint that the archive must leave behind."""
    files = []
    for record in records:
        folder = root / ",".join(record["overrides"])
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"weights")
        files.append(write_json_atomic(folder / RESULTS_FILE, record))
    return files


def test_archived_records_redraw_the_same_table_without_the_logs(tmp_path):
    """The archive keeps every record, at its relative folder, and nothing else; the table drawn from
    it equals the one drawn from the sweep folder; archiving again writes nothing."""
    logs = tmp_path / "logs" / "results"
    _write_sweep(logs / "scaling", SCALING)
    archive = tmp_path / "docs" / "runs"
    written = archive_records(logs, archive)
    assert len(written) == len(SCALING)
    assert sorted(p.relative_to(archive) for p in archive.rglob("*") if p.is_file()) == sorted(
        p.relative_to(logs) for p in logs.rglob(RESULTS_FILE)
    )
    assert not list(archive.rglob("*.ckpt"))
    assert markdown_table(load_results(archive)) == markdown_table(load_results(logs))
    assert archive_records(logs, archive) == []


def test_merging_tables_replaces_the_sections_of_the_sweeps_drawn_and_keeps_the_others():
    """A results.md of the language and Pareto sweeps, then the Pareto sweep redrawn from its width-64 runs
    alone: the merge holds the new Pareto section in the old one's place, the language section as it was,
    and one closing note; merging a table with itself gives it back."""
    both = markdown_table(_results(LANGUAGE + PARETO))
    assert merge_markdown_tables(both, both) == (both, [])
    width_64 = [r for r in PARETO if "model.embed_dim=64" in r["overrides"]]
    redrawn = markdown_table(_results(width_64))
    merged, kept = merge_markdown_tables(both, redrawn)
    assert kept == ["results_language"]
    language, pareto = merged.split("#### ")[1:]
    assert both.split("#### ")[1] == language, "the kept section is unchanged, in its place"
    assert redrawn.startswith("#### " + pareto), "the Pareto section is the redrawn one, note and all"
    assert "embed_dim=128" in both and "embed_dim=128" not in merged
    assert merged.count("Values over several seeds") == 1 and "bench step ms" not in merged
    benched = merge_markdown_tables(merged, redrawn.replace("| step ms |", "| step ms | bench step ms |"))[0]
    assert benched.endswith("timed by scripts/bench_models.py.\n"), "a bench column gets the note of its column"


@pytest.mark.e2e
def test_plot_script_redraws_one_sweep_beside_the_sections_of_the_others(tmp_path):
    """Drawing the scaling sweep into a folder whose results.md also holds the language sweep (records not at
    hand) keeps the language section and figure, says so, and replaces the scaling section."""
    out = tmp_path / "figures"
    for name, records in (("language", LANGUAGE), ("scaling", SCALING)):
        _write_sweep(tmp_path / "runs" / name, records)
        plot = run_script("plot_results.py", str(tmp_path / "runs" / name), "--out", str(out), cwd=tmp_path)
        assert plot.returncode == 0, plot.stderr[-3000:]
    assert "kept from the existing" in plot.stderr and "results_language" in plot.stderr
    table = (out / "results.md").read_text()
    assert table == markdown_table(_results(LANGUAGE)).rsplit("\n\n", 1)[0] + "\n\n" + markdown_table(_results(SCALING))
    assert {p.name for p in out.glob("*.png")} == {"language.png", "scaling.png"}


def test_archiving_a_rerun_of_an_archived_seed_needs_replace(tmp_path):
    """A second session's run of the same setting and seed (another machine, another draw) must not
    overwrite the archived one silently: the error names the archived file; --replace keeps the new."""
    logs, archive = tmp_path / "logs", tmp_path / "runs"
    _write_sweep(logs, SCALING[:2])
    archive_records(logs, archive)
    rerun = logs / ",".join(SCALING[0]["overrides"]) / RESULTS_FILE
    record = json.loads(rerun.read_text())
    record["metrics"]["test"]["acc"] = 0.5
    write_json_atomic(rerun, record)
    archived = archive / rerun.relative_to(logs)
    with pytest.raises(ValueError, match=f"differs from the record archived for its setting and seed, '{archived}'"):
        archive_records(logs, archive)
    assert json.loads(archived.read_text())["metrics"]["test"]["acc"] == 0.8
    assert archive_records(logs, archive, replace=True) == [archived]
    assert json.loads(archived.read_text())["metrics"]["test"]["acc"] == 0.5


@pytest.mark.e2e
def test_archive_script_refuses_an_unreadable_record_and_writes_nothing(tmp_path):
    logs, archive = tmp_path / "logs", tmp_path / "runs"
    _write_sweep(logs, SCALING[:2])
    (logs / "broken").mkdir()
    (logs / "broken" / RESULTS_FILE).write_text("{not json")
    run = run_script("archive_runs.py", str(logs), str(archive), cwd=tmp_path)
    assert run.returncode == 1 and "broken/results.json" in run.stderr and "Traceback" not in run.stderr
    assert not archive.exists()
    (logs / "broken" / RESULTS_FILE).unlink()
    run = run_script("archive_runs.py", str(logs), str(archive), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "2 record(s) archived" in run.stdout and len(list(archive.rglob(RESULTS_FILE))) == 2


# ---------------------------------------------------------------------------------------------
# Benchmarked step times in place of the recorded times


def _step_row(model_config, seconds: float, batch_size: int = 100, precision: str = "bf16-mixed") -> dict:
    return {
        "name": str(model_config),
        "model_config": model_config,
        "batch_size": batch_size,
        "precision": precision,
        "seconds_per_step": seconds,
        "examples_per_step": batch_size,
    }


def test_step_times_go_to_the_runs_of_the_same_model_batch_and_precision(tmp_path):
    runs = _results(PARETO)  # 1000 examples a run, batches of 100: 10 steps
    dense_64 = {"name": ["model=dense_vit", "model.embed_dim=64"]}
    soft_64 = {"name": ["model=soft_moe_vit", "model.embed_dim=64"]}
    rows = [
        _step_row(dense_64, 0.5),
        _step_row(soft_64, 0.25, batch_size=50),  # another batch size: another step, no match
        _step_row(soft_64, 0.75, precision="32-true"),  # another precision: no match
    ]
    step_times = load_step_times([_write_step_times(tmp_path / "steps.json", [{"title": "t", "rows": rows}])])
    timed = attach_step_times(runs, step_times)
    assert [r.path for r in timed] == [r.path for r in runs]
    matched = [r for r in timed if r.bench_step_seconds is not None]
    assert len(matched) == 3 and all(
        dict(r.setting) == {"model": "dense_vit", "model.embed_dim": "64"} for r in matched
    )
    assert all(r.bench_seconds == pytest.approx(0.5 * 10) for r in matched)
    assert all(r.bench_seconds is None for r in timed if r not in matched)
    # The table gains the benchmarked step next to the recorded one.
    table = markdown_table(timed)
    assert "| bench step ms |" in table and "| 500 |" in table
    assert "| bench step ms |" not in markdown_table(runs) and "bench_models" not in markdown_table(runs)


def _timed(runs: list[RunResult], seconds, path: Path) -> list[RunResult]:
    """``runs`` with the step times ``seconds(run)`` of their models, through a step-time file."""
    rows = {r.step_key: _step_row(json.loads(r.step_key)["model"], seconds(r)) for r in runs}
    return attach_step_times(
        runs, load_step_times([_write_step_times(path, [{"title": "t", "rows": list(rows.values())}])])
    )


def test_the_time_axes_use_the_benchmarked_steps_when_every_run_has_one(tmp_path, monkeypatch):
    import moekit.analysis.figures as results

    drawn = {}

    def keep(fig, out, **_):  # each panel's label and points instead of a file
        drawn[out.name] = [
            (
                ax.get_xlabel(),
                ax.get_ylabel(),
                [(list(c.lines[0].get_xdata()), list(c.lines[0].get_ydata())) for c in ax.containers],
            )
            for ax in fig.axes
        ]
        results.pyplot().close(fig)
        return out

    monkeypatch.setattr(results, "_save", keep)
    pareto = _results(PARETO)  # 10 steps a run; recorded fit times width + 1, 2, 6 s: median width + 2
    width = {r.step_key: int(dict(r.setting)["model.embed_dim"]) for r in pareto}
    plot_pareto(_timed(pareto, lambda r: width[r.step_key] / 1000, tmp_path / "p.json"), tmp_path / "bench.png")
    plot_pareto(pareto, tmp_path / "recorded.png")
    (_, _, _), (label, _, lines) = drawn["bench.png"]
    assert "benchmarked step" in label
    assert sorted(x for xs, _ in lines for x in xs) == pytest.approx([0.64, 0.64, 1.28, 1.28])  # 10 x step
    (_, _, _), (label, _, lines) = drawn["recorded.png"]
    assert "as recorded" in label
    assert sorted(x for xs, _ in lines for x in xs) == [66, 66, 130, 130]

    scaling = _results(SCALING)  # recorded steps: num_experts seconds
    plot_scaling(_timed(scaling, lambda r: 0.002 * r.num_experts, tmp_path / "s.json"), tmp_path / "scaling.png")
    (label, ylabel, lines), _ = drawn["scaling.png"]
    assert "benchmarked" in ylabel
    assert sorted(y for _, ys in lines for y in ys) == pytest.approx([16, 16, 128, 128, 512, 512])  # ms
    # One run without a step time: the figure keeps the recorded times for all.
    partial = _timed(scaling[1:], lambda r: 0.002 * r.num_experts, tmp_path / "s2.json") + scaling[:1]
    plot_scaling(partial, tmp_path / "partial.png")
    (_, ylabel, _), _ = drawn["partial.png"]
    assert "as recorded" in ylabel


def test_the_dense_runs_of_the_scaling_sweep_are_a_reference_line(tmp_path, monkeypatch):
    import moekit.analysis.figures as results

    drawn = {}

    def keep(fig, out, **_):  # each panel's horizontal lines and shaded bands instead of a file
        drawn[out.name] = [
            (
                [(list(line.get_ydata()), line.get_label()) for line in ax.lines if line.get_linestyle() == "--"],
                [(patch.get_y(), patch.get_y() + patch.get_height()) for patch in ax.patches],
                [list(c.lines[0].get_xdata()) for c in ax.containers],
            )
            for ax in fig.axes
        ]
        results.pyplot().close(fig)
        return out

    monkeypatch.setattr(results, "_save", keep)
    dense = [
        _record("results_scaling", "dense", seed, ["model=dense_vit"], acc=acc, step=step)
        for seed, (acc, step) in enumerate(((0.70, 0.3), (0.76, 0.5), (0.73, 0.4)))
    ]
    plot_scaling(_results(SCALING + dense), tmp_path / "scaling.png")
    (step_lines, step_band, step_points), (acc_lines, acc_band, acc_points) = drawn["scaling.png"]
    assert step_lines == [([400.0, 400.0], "dense")]  # the median step, ms
    assert step_band == [(300.0, 500.0)]  # min-max over the seeds
    assert acc_lines[0][0] == pytest.approx([73.0, 73.0]) and acc_lines[0][1] == "dense"  # the mean accuracy, %
    assert acc_band == [pytest.approx((70.0, 76.0))]
    assert all(0 not in xs for xs in step_points + acc_points), "no dense point on the log2 experts axis"
    assert sorted(x for xs in acc_points for x in xs) == [8, 8, 64, 64, 256, 256]


def test_step_time_files_that_cannot_be_used_say_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench_models.py --json"):
        load_step_times([tmp_path / "missing.json"])
    write_json_atomic(tmp_path / "run.json", {"kind": "something else", "tables": []})
    with pytest.raises(ValueError, match="run.json.*not a step-time file"):
        load_step_times([tmp_path / "run.json"])
    row = _step_row({"name": "m"}, 0.5)
    first = _write_step_times(tmp_path / "a.json", [{"title": "t", "rows": [row]}])
    second = _write_step_times(tmp_path / "b.json", [{"title": "t", "rows": [row]}])
    with pytest.raises(ValueError, match="timed twice.*a.json"):
        load_step_times([first, second])
    assert step_time_key({"a": 1, "b": 2}, 4, "32-true") == step_time_key({"b": 2, "a": 1}, 4, "32-true")


@pytest.mark.e2e
def test_plot_script_takes_step_times_and_names_the_runs_left_without(tmp_path):
    for i, record in enumerate(PARETO + ABLATIONS):
        (tmp_path / "runs" / f"run{i}").mkdir(parents=True)
        write_json_atomic(tmp_path / "runs" / f"run{i}" / RESULTS_FILE, record)
    runs = _results(PARETO)
    rows = {r.step_key: _step_row(json.loads(r.step_key)["model"], 0.1) for r in runs}
    steps = _write_step_times(tmp_path / "steps.json", [{"title": "t", "rows": list(rows.values())}])
    plot = run_script("plot_results.py", str(tmp_path / "runs"), "--step-times", str(steps), cwd=tmp_path)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert "| bench step ms |" in plot.stdout
    assert "6 run(s) of results_ablation_l2norm have no step time" in plot.stderr
    assert "9 run(s) of results_ablation_slots have no step time" in plot.stderr
    assert "results_pareto" not in plot.stderr
    bad = run_script(
        "plot_results.py", str(tmp_path / "runs"), "--step-times", str(tmp_path / "none.json"), cwd=tmp_path
    )
    assert bad.returncode == 1 and "none.json" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(("count", "unit"), [("elements", "token"), ("rows", "image")])
def test_a_record_without_a_model_summary_takes_its_unit_from_what_the_counter_counted(count, unit):
    """train() goes on when the model summary cannot be measured (summary None): a language model's record said
    "images/s" and FLOPs per "image" though its counter counted tokens (a batch's elements)."""
    from types import SimpleNamespace

    from moekit.analysis.records import build_run_record

    record = build_run_record(
        run_config={"task_name": "run", "model": {}},
        overrides=[],
        net=torch.nn.Linear(2, 2),
        summary=None,
        counter=ThroughputMonitor(count=count, log=False),
        metrics={},
        trainer=SimpleNamespace(),
    )
    assert record["flops"]["example"] == unit and record["training"]["throughput_unit"] == f"{unit}s/s"
