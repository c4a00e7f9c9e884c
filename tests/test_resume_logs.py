"""A run killed at any moment and resumed from its ``last.ckpt`` into the same folder ends with the logs of the
uninterrupted run: the same ``metrics.csv`` rows and TensorBoard scalars, step for step, validation and training
epoch means included, none twice; and with the same weights.

The runs train the tiny Soft MoE ViT (``debug=tiny``: 10 steps per epoch, 2 epochs, float32, deterministic), a
``last.ckpt`` every 3 steps and at each epoch's end, one log row per step. Each case dies at one moment
(``kill_points``): SIGKILL right after a mid-epoch step checkpoint is written, SIGKILL in the middle of writing one
(the resume then starts from the one before), SIGKILL right after the epoch-end ``last.ckpt``, SIGKILL after the
best-epoch checkpoint with ``last.ckpt`` still at the step before, and SIGTERM during the epoch's last batch (the
pre-emption checkpoint waits for that epoch's validation) or in the middle of an epoch.
"""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import pytest
from kill_points import kill_overrides

from conftest import built_once
from resume_helpers import (
    TIMING_SUFFIX,
    assert_same_training_state,
    finish,
    load_checkpoint,
    metrics_rows,
    start,
    tensorboard_scalars,
    train_command,
)

pytestmark = pytest.mark.e2e  # trains models in subprocesses

STEPS_PER_EPOCH, EPOCHS = 10, 2
OVERRIDES = [
    "experiment=soft_moe_vit",
    "debug=tiny",
    "logger=many",
    "trainer.precision=32-true",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    f"trainer.max_epochs={EPOCHS}",
    "callbacks.last_checkpoint_steps.every_n_train_steps=3",
    "test=false",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    def build(out: Path) -> None:
        status, output = finish(start(train_command(*OVERRIDES, f"paths.output_dir={out}")))
        assert status == 0, output[-3000:]

    return built_once(tmp_path_factory, "resume_logs_reference", build)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "step", "exit_status", "resumed_step"),
    [
        ("kill_after_write", 6, -9, 6),  # mid-epoch step checkpoint, killed before the step's row was logged
        ("kill_during_write", 6, -9, 3),  # the temporary file written, not renamed: last.ckpt of step 3 remains
        ("kill_after_write", 10, -9, 10),  # the epoch-end last.ckpt, killed before the epoch's means were logged
        ("SIGTERM", 9, 143, 10),  # in the epoch's last batch: saved after the validation that follows it
        ("SIGTERM", 13, 143, 14),  # mid-epoch pre-emption
    ],
    ids=["after-step-save", "mid-save", "after-epoch-save", "sigterm-last-batch", "sigterm-mid-epoch"],
)
def test_a_killed_run_resumes_to_the_logs_of_the_uninterrupted_run(
    reference, tmp_path, kind, step, exit_status, resumed_step
):
    args = train_command(*OVERRIDES, f"paths.output_dir={tmp_path}")
    status, output = finish(start([*args, *kill_overrides(kind, step)]))
    assert status == exit_status, output[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["global_step"] == resumed_step
    if kind == "kill_during_write":
        assert list(last.parent.glob(".last.ckpt.*.tmp")), "the interrupted write left its temporary file"

    status, output = finish(start([*args, "ckpt_path=last"]))
    assert status == 0, output[-3000:]
    assert not list(last.parent.glob(".*.tmp")), "the stale temporary file is removed"
    assert_same_training_state(
        load_checkpoint(last), load_checkpoint(reference / "checkpoints" / "last.ckpt"), EPOCHS * STEPS_PER_EPOCH
    )
    rows, reference_rows = metrics_rows(tmp_path), metrics_rows(reference)
    assert any("val/acc" in row for row in rows) and any("train/acc" in row for row in rows)
    assert rows == reference_rows
    assert tensorboard_scalars(tmp_path) == tensorboard_scalars(reference)


TRACKERS = [name for name in ("mlflow", "wandb") if importlib.util.find_spec(name) is not None]


@pytest.fixture(scope="module")
def tracked_resume(tmp_path_factory) -> Path:
    """A run logging to CSV and to the tracking stores that are installed (MLflow in a SQLite store beside it,
    W&B offline), SIGKILLed in the middle of writing the step-6 checkpoint (its rows up to step 5 logged, the last
    checkpoint at step 3) and resumed with ``ckpt_path=last`` to the end of its epoch; its folder."""
    if not TRACKERS:
        pytest.skip("neither mlflow nor wandb is installed (pip install -e '.[loggers]')")

    def build(out: Path) -> None:
        args = train_command(
            *[o for o in OVERRIDES if not o.startswith(("logger=", "trainer.max_epochs="))],
            f"logger=[csv,{','.join(TRACKERS)}]",
            "trainer.max_epochs=1",
            f"paths.output_dir={out}",
            f"hydra.run.dir={out}",
            *([f"logger.mlflow.tracking_uri=sqlite:///{out}/mlflow.db"] if "mlflow" in TRACKERS else []),
        )
        with pytest.MonkeyPatch.context() as env:  # W&B's settings and caches in the test's folder
            for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
                env.setenv(name, str(out / "wandb-home"))
            env.setenv("WANDB_MODE", "offline")
            status, output = finish(start([*args, *kill_overrides("kill_during_write", 6)]))
            assert status == -9, output[-3000:]
            assert load_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == 3
            status, output = finish(start([*args, "ckpt_path=last"]))
        assert status == 0, output[-3000:]

    return built_once(tmp_path_factory, "resume_logs_tracked", build)


def test_a_resumed_run_continues_its_mlflow_run(tracked_resume):
    """One MLflow run over both processes, finished, whose metric history holds each value of the run's
    ``metrics.csv`` (the uninterrupted run's rows) once: steps 3-5, logged by both processes, are not doubled."""
    mlflow = pytest.importorskip("mlflow")
    client = mlflow.MlflowClient(f"sqlite:///{tracked_resume}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, f"a resume must continue the run, not open another: {[r.info.run_id for r in runs]}"
    run = runs[0]
    assert run.info.status == "FINISHED"
    expected = collections.defaultdict(list)
    for row in metrics_rows(tracked_resume):
        for key, value in row.items():
            if key not in ("step", "epoch"):
                expected[key, int(row["step"])].append(float(value))
    history = collections.defaultdict(list)
    for key in run.data.metrics:
        if key != "epoch" and not key.endswith(TIMING_SUFFIX):
            for metric in client.get_metric_history(run.info.run_id, key):
                history[key, metric.step].append(metric.value)
    assert {k: sorted(v) for k, v in history.items()} == {k: sorted(v) for k, v in expected.items()}
    assert sorted(s for k, s in history if k == "train/loss_step") == list(range(STEPS_PER_EPOCH))


def test_a_resumed_run_continues_its_wandb_run(tracked_resume):
    """Both processes log offline to the same W&B run id (each into its own ``offline-run-<time>-<id>`` folder)."""
    pytest.importorskip("wandb")
    folders = sorted((tracked_resume / "wandb").glob("offline-run-*"))
    assert len(folders) == 2, folders
    assert len({folder.name.rsplit("-", 1)[1] for folder in folders}) == 1, f"two W&B runs: {folders}"


def test_a_continued_mlflow_run_keeps_its_parameters_and_logs_a_held_value_once(tmp_path, caplog):
    """In one process: a run logs steps 0-3; a logger continuing it from the position of a checkpoint at step 1
    leaves out the values the run holds at steps 2-3, keeps both values of a step logged again with another value,
    and keeps the first value of a changed parameter (MLflow refuses a change). A run the store does not hold is
    said so, and a new run opened."""
    pytest.importorskip("mlflow")
    from moekit.loggers import MLFlowLogger, continue_runs

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MLFlowLogger(experiment_name="resume", tracking_uri=uri)
    first.log_hyperparams({"ckpt_path": None, "lr": 0.1})
    for step in range(2):
        first.log_metrics({"loss": 1.0 + step}, step=step)
    positions = {first.position_key: first.position()}
    for step in range(2, 4):
        first.log_metrics({"loss": 1.0 + step}, step=step)

    resumed = MLFlowLogger(experiment_name="resume", tracking_uri=uri)
    continue_runs([resumed], positions)
    resumed.log_hyperparams({"ckpt_path": "last.ckpt", "lr": 0.1, "seed": 1})
    for step, value in [(2, 3.0), (3, 4.5), (4, 5.0)]:
        resumed.log_metrics({"loss": value}, step=step)
    resumed.finalize("success")
    assert resumed.run_id == first.run_id
    run = resumed.experiment.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"ckpt_path": "None", "lr": "0.1", "seed": "1"}
    history = sorted((m.step, m.value) for m in resumed.experiment.get_metric_history(first.run_id, "loss"))
    assert history == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0), (3, 4.5), (4, 5.0)]

    gone = MLFlowLogger(experiment_name="resume", tracking_uri=uri)
    continue_runs([gone], {gone.position_key: {"id": "0" * 32, "step": 3}})
    assert gone.run_id not in (first.run_id, "0" * 32)
    assert "not continued" in caplog.text
