"""``trainer.precision=auto``, the experiments' setting: bf16 autocast where the machine trains faster in it. The CPU's
flags decide where they can (AMX: bf16; no bf16 dot products: float32); with ``avx512_bf16`` alone the run's own
training step is timed both ways on a copy of its model, and the run, its log, its record and the DDP ranks it
starts all hold the choice."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import compose_config, small_overrides
from moekit.commands import common
from moekit.configs import instantiate
from moekit.tasks import precision as step_precision
from moekit.utils import machine
from moekit.utils.machine import BF16_MARGIN, resolve_precision


def _never():
    raise AssertionError("measured where the CPU's flags decide")


@pytest.mark.parametrize(
    ("flags", "expected", "says"),
    [
        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bf16-mixed", "has AMX"),
        ({"avx2", "fma"}, "32-true", "no bf16 dot products"),
        (set(), "32-true", "no bf16 dot products"),
    ],
)
def test_the_cpus_flags_decide_without_measuring_where_they_can(flags, expected, says):
    precision, why = resolve_precision("auto", "cpu", flags, measure=_never)
    assert precision == expected and says in why
    assert resolve_precision("bf16-mixed", "cpu", set(), measure=_never) == ("bf16-mixed", "as configured")


@pytest.mark.parametrize(
    ("bf16_seconds", "expected"),
    [(0.5, "bf16-mixed"), (1 / BF16_MARGIN, "bf16-mixed"), (0.95, "32-true"), (1.6, "32-true")],
)
def test_bf16_dot_products_alone_are_measured_and_bf16_must_win_by_the_margin(bf16_seconds, expected):
    """A Zen 4 EPYC trained the main job 1.7x faster in bf16 autocast, a Xeon 1.67x slower, both with avx512_bf16 and
    no AMX: only a measurement tells them apart, and float32, the more accurate, keeps a tie."""
    times = {"32-true": 1.0, "bf16-mixed": bf16_seconds}
    precision, why = resolve_precision("auto", "cpu", {"avx512f", "avx512_bf16"}, measure=lambda: times)
    assert precision == expected
    assert f"{bf16_seconds * 1e3:.0f} ms in bf16 autocast against 1000 ms in float32" in why
    assert f"({1 / bf16_seconds:.2f}x" in why
    not_measured = resolve_precision("auto", "cpu", {"avx512f", "avx512_bf16"})
    assert not_measured[0] == "32-true" and "not measured" in not_measured[1]


def test_precision_auto_takes_float16_on_gpus_that_only_emulate_bf16(monkeypatch):
    """A V100 or T4 (compute capability 7.x) runs bf16 only emulated, slower than float16: ``16-mixed`` there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert resolve_precision("auto", "gpu", measure=_never) == ("16-mixed", "Tesla T4 has no bf16")
    assert resolve_precision("auto", "auto")[0] == "16-mixed"


@pytest.fixture
def bf16_without_amx(monkeypatch):
    """This CPU as one with bf16 dot products and no AMX, where ``auto`` measures; no choice handed over."""
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    for name in (common.PRECISION_HANDOVER, "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def _auto_config(fake_fashion, tmp_path, *extra):
    return compose_config(
        "train", [*small_overrides(fake_fashion), "trainer.precision=auto", "data.batch_size=24", *extra], tmp_path
    )


def test_the_measurement_times_the_runs_step_on_a_copy_and_leaves_its_random_state(
    fake_fashion, tmp_path, bf16_without_amx, monkeypatch
):
    """The run's model is built after the measurement: its weights, its data order and its dropout draw the same
    numbers as where nothing was measured. What is timed is the configured network at the data's batch size."""
    timed = []

    def spy(task, batch, precisions, rounds=2):
        timed.append((task, batch, precisions))
        return step_precision.forward_backward_seconds(task, batch, precisions, rounds=1)

    monkeypatch.setattr(common, "forward_backward_seconds", spy)
    cfg = _auto_config(fake_fashion, tmp_path, "task.init_from=/not/read.ckpt", "task.compile=true")
    datamodule = instantiate(cfg.data, _convert_="all")
    torch.manual_seed(3)
    state = torch.get_rng_state()
    why = common.choose_precision(cfg, datamodule)
    assert torch.equal(torch.get_rng_state(), state)
    assert cfg.trainer.precision in ("32-true", "bf16-mixed") and "; measured, a training step" in why
    [(task, (images, labels), precisions)] = timed
    assert precisions == ("32-true", "bf16-mixed")
    assert images.shape == (24, 1, 28, 28) and labels.shape == (24,)
    built = instantiate(cfg.task, net=cfg.model, init_from=None, _recursive_=False)  # the weights were not read
    shapes = {k: v.shape for k, v in built.net.state_dict().items()}
    assert {k: v.shape for k, v in task.net.state_dict().items()} == shapes
    assert all(p.grad is None for p in task.parameters()), "the gradients are dropped after each step"
    assert task.frames_before_compile is None, "timed eager: compiling it in each precision would cost more"


def test_a_bf16_step_that_fails_when_measured_leaves_the_run_in_float32(
    fake_fashion, tmp_path, bf16_without_amx, monkeypatch, caplog
):
    """A bf16 kernel this CPU lacks fails the measured step, not the run: float32, and the error logged."""

    def fails(task, batch, precisions, rounds=2):
        raise RuntimeError("could not create a primitive descriptor for an LSTM forward propagation primitive\n...")

    monkeypatch.setattr(common, "forward_backward_seconds", fails)
    cfg = _auto_config(fake_fashion, tmp_path)
    with caplog.at_level("WARNING", logger="moekit"):
        why = common.choose_precision(cfg, instantiate(cfg.data, _convert_="all"))
    assert cfg.trainer.precision == "32-true" and "bf16 autocast failed when measured" in why
    assert "failed when measured: could not create a primitive descriptor" in caplog.text


def test_a_ddp_rank_takes_its_starters_choice_and_launched_processes_do_not_measure(
    fake_fashion, tmp_path, bf16_without_amx, monkeypatch
):
    cfg = _auto_config(fake_fashion, tmp_path)
    datamodule = instantiate(cfg.data, _convert_="all")
    monkeypatch.setattr(common, "forward_backward_seconds", lambda *a, **k: {"32-true": 1.0, "bf16-mixed": 0.5})
    assert "; measured, a training step" in common.choose_precision(cfg, datamodule)
    assert cfg.trainer.precision == "bf16-mixed"
    handed = os.environ[common.PRECISION_HANDOVER]
    assert handed.startswith(f"{os.getpid()}:bf16-mixed:")

    # A rank Lightning started (LOCAL_RANK, its parent the measuring process) takes that choice without measuring.
    monkeypatch.setattr(common, "forward_backward_seconds", lambda *a, **k: _never())
    monkeypatch.setattr(os, "getppid", lambda: int(handed.split(":")[0]))
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg.trainer.precision = "auto"
    assert common.choose_precision(cfg, datamodule).startswith("the choice of the process that started this one")
    assert cfg.trainer.precision == "bf16-mixed"

    # Another process's choice (a sweep's earlier job in this process, a notebook's) is measured anew, or, in a
    # process a launcher started with others, which could measure otherwise, not measured at all.
    monkeypatch.setattr(os, "getppid", lambda: 1)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    cfg.trainer.precision = "auto"
    assert "not measured" in common.choose_precision(cfg, datamodule) and cfg.trainer.precision == "32-true"


def test_the_experiments_train_in_the_measured_precision_and_record_why(
    fake_fashion, tmp_path, caplog, bf16_without_amx
):
    from moekit.commands.train import train

    for experiment in ("soft_moe_vit", "moe_transformer_lm", "moe_lstm_lm"):
        composed = compose_config("train", [f"experiment={experiment}"], tmp_path / experiment)
        assert composed.trainer.precision == "auto", "the experiments leave the precision to the machine"
    cfg = _auto_config(fake_fashion, tmp_path, "trainer.fast_dev_run=true")
    with caplog.at_level("INFO", logger="moekit"):
        train(cfg)
    record = json.loads((tmp_path / "results.json").read_text())["training"]["precision"]
    assert record["value"] == cfg.trainer.precision in ("32-true", "bf16-mixed")
    assert "; measured, a training step" in record["reason"]
    assert f"trainer.precision=auto: {record['value']} ({record['reason']})" in caplog.text


@pytest.mark.parametrize(("bf16_seconds", "ns_dtype"), [(0.5, "bfloat16"), (2.0, "float32")])
def test_muons_newton_schulz_steps_follow_the_measured_precision(
    fake_fashion, tmp_path, caplog, bf16_without_amx, monkeypatch, bf16_seconds, ns_dtype
):
    """With avx512_bf16 alone the flag does not tell whether bf16 matmuls pay (a Xeon whose oneDNN was held to
    avx512_bf16 ran them 1.7x slower than float32): Muon's ``ns_dtype=auto`` takes the dtype the run's step was
    measured faster in, and every DDP rank, which takes rank 0's precision, takes the same."""
    from moekit.commands.train import train

    times = {"32-true": 1.0, "bf16-mixed": bf16_seconds}
    monkeypatch.setattr(common, "forward_backward_seconds", lambda *a, **k: times)
    cfg = _auto_config(fake_fashion, tmp_path, "trainer.fast_dev_run=true", "task.optimizer.name=muon")
    with caplog.at_level("INFO", logger="moekit"):
        train(cfg)
    assert f"Newton-Schulz steps in {ns_dtype} on cpu (ns_dtype=auto)" in caplog.text


@pytest.mark.parametrize(
    ("trained_in", "flags", "expected", "kept"),
    [
        ("32-true", {"avx512f", "avx512_bf16"}, "32-true", True),  # measured bf16 2x faster: the run stays float32
        ("bf16-mixed", {"avx512f", "avx512_bf16"}, "bf16-mixed", True),
        ("bf16-mixed", {"avx2"}, "32-true", False),  # no bf16 dot products here: emulated bf16 is not kept
        ("auto", {"avx512f", "avx512_bf16"}, "bf16-mixed", False),  # unknown: measured
    ],
)
def test_a_resumed_run_keeps_the_precision_it_trained_in_where_this_machine_runs_it(
    fake_fashion, tmp_path, bf16_without_amx, monkeypatch, trained_in, flags, expected, kept
):
    """Resuming continues a run: an interrupted run measured anew could train its second half in another precision
    (a requeue onto another kind of node, a measurement near the margin). Its checkpoint's own precision is kept,
    unless this machine would only emulate it."""
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    monkeypatch.setattr(common, "forward_backward_seconds", lambda *a, **k: {"32-true": 1.0, "bf16-mixed": 0.5})
    ckpt = tmp_path / "last.ckpt"
    run_config = {"trainer": {"precision": trained_in}}
    torch.save(
        {"state_dict": {}, "optimizer_states": [], "epoch": 1, "hyper_parameters": {"run_config": run_config}}, ckpt
    )
    cfg = _auto_config(fake_fashion, tmp_path)
    why = common.choose_precision(cfg, instantiate(cfg.data, _convert_="all"), checkpoint=str(ckpt))
    assert cfg.trainer.precision == expected
    assert (why == f"the precision the run of ckpt_path={ckpt} trained in") == kept, why


def test_eval_of_a_checkpoint_tests_it_in_the_precision_its_run_trained_in(
    fake_fashion, tmp_path, bf16_without_amx, monkeypatch, caplog
):
    """``scripts/eval.py`` (``trainer.precision=auto`` by default) repeats the run's own test phase: the precision it
    trained and tested in, not a new measurement."""
    from moekit.commands.evaluate import evaluate
    from moekit.commands.train import train

    run = tmp_path / "run"
    train(compose_config("train", [*small_overrides(fake_fashion), "trainer.precision=bf16-mixed"], run))
    ckpt = next((run / "checkpoints").glob("epoch_*.ckpt"))
    monkeypatch.setattr(common, "forward_backward_seconds", lambda *a, **k: _never())
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", "logger=csv"], tmp_path / "eval")
    with caplog.at_level("INFO", logger="moekit"):
        evaluate(cfg)
    assert f"trainer.precision=auto: bf16-mixed (the precision the run of ckpt_path={ckpt} trained in)" in caplog.text
