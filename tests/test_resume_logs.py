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

from pathlib import Path

import pytest
from kill_points import kill_overrides

from resume_helpers import (
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
    out = tmp_path_factory.mktemp("reference")
    status, output = finish(start(train_command(*OVERRIDES, f"paths.output_dir={out}")))
    assert status == 0, output[-3000:]
    return out


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
