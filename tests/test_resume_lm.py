"""A killed language-model run resumes to the same result, and a run resumed into its own folder keeps
its earlier logs.

The runs train a tiny MoE Transformer LM (``experiment=moe_transformer_lm``: 2 blocks of 4 top-2
SwiGLU experts, dim 32, dropout 0.1) on the first 2,800 bytes of the pydoc corpus with the byte
tokenizer, 32-token windows in batches of 8: 8 steps per epoch, float32, ``trainer.deterministic=true``
on CPU, CSV and TensorBoard logs. The kill test runs real ``scripts/train.py`` subprocesses: an
uninterrupted run is the reference; another is SIGKILLed a few steps after a mid-epoch ``last.ckpt``
and resumed from it into the same folder, and must end with bit-identical weights, optimizer state and
test metrics, and a ``metrics.csv`` with the same rows as the reference's.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from conftest import compose_config
from moekit.commands.train import train
from moekit.data import load_corpus
from moekit.data.tokenizers import DOCUMENT_SEPARATOR
from moekit.loggers import ResumableCSVLogger
from resume_helpers import (
    assert_same_training_state,
    finish,
    kill,
    load_checkpoint,
    logged_steps,
    metrics_rows,
    printed_test_metrics,
    start,
    tensorboard_scalars,
    train_command,
    wait_for,
)

pytestmark = pytest.mark.e2e  # fits models in subprocesses (make test-fast leaves it out)

EPOCHS, STEPS_PER_EPOCH, EVERY_N_STEPS = 3, 8, 5
KILL_AFTER_STEP = 11  # the kill comes once this step is logged: after last.ckpt of step 10 (epoch 1, batch 2)
CORPUS_BYTES = 2800  # 80% train: 69 windows of 32 tokens, 8 batches of 8 (drop_last); 8 val and 8 test windows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first ``CORPUS_BYTES`` characters (ASCII) of the pydoc corpus as one text file."""
    text = DOCUMENT_SEPARATOR.join(load_corpus("pydoc"))[:CORPUS_BYTES]
    assert len(text.encode("utf-8")) == CORPUS_BYTES
    path = tmp_path_factory.mktemp("corpus") / "pydoc_head.txt"
    path.write_text(text, encoding="utf-8")
    return path


def lm_overrides(corpus: Path, *extra: str) -> list[str]:
    return [
        "experiment=moe_transformer_lm",
        "debug=tiny",
        "data=text_files",
        f"data.paths=[{corpus}]",
        "data.seq_len=32",
        "data.batch_size=8",
        "data.val_fraction=0.1",
        "data.test_fraction=0.1",
        "trainer.limit_train_batches=null",
        "trainer.limit_val_batches=null",
        "trainer.limit_test_batches=null",
        "moe.num_experts=4",
        "logger=many",
        "trainer.precision=32-true",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.deterministic=true",
        f"callbacks.last_checkpoint_steps.every_n_train_steps={EVERY_N_STEPS}",
        *extra,
    ]


class Reference(NamedTuple):
    """What the uninterrupted run left: its final last.ckpt, printed test metrics, metrics.csv rows
    and TensorBoard scalars (:func:`metrics_rows`, :func:`tensorboard_scalars`)."""

    checkpoint: dict
    test_metrics: dict[str, float]
    rows: list[dict[str, str]]
    scalars: dict


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Reference:
    out = tmp_path_factory.mktemp("reference")
    status, output = finish(start(train_command(*lm_overrides(corpus, f"paths.output_dir={out}"))))
    assert status == 0, output[-3000:]
    checkpoint = load_checkpoint(out / "checkpoints" / "last.ckpt")
    return Reference(checkpoint, printed_test_metrics(output), metrics_rows(out), tensorboard_scalars(out))


@pytest.mark.slow
def test_killed_lm_run_resumes_to_the_same_weights_metrics_and_logs(corpus, reference, tmp_path):
    out = tmp_path / "run"
    last = out / "checkpoints" / "last.ckpt"
    metrics_csv = out / "csv" / "metrics.csv"
    args = train_command(*lm_overrides(corpus, f"paths.output_dir={out}"))

    # SIGKILL a few steps after a mid-epoch last.ckpt, while the run trains on. Each checkpoint write
    # pauses 0.5 s before its rename, so the kill lands before the next last.ckpt (step 15) replaces it.
    proc = start(args, write_delay=0.5)
    wait_for(lambda: last.exists() and max(logged_steps(metrics_csv), default=-1) >= KILL_AFTER_STEP, proc, "step 11")
    kill(proc)
    saved_step = load_checkpoint(last)["global_step"]
    assert saved_step == 2 * EVERY_N_STEPS and saved_step % STEPS_PER_EPOCH, "a mid-epoch checkpoint"
    killed_rows = metrics_rows(out)
    assert max(int(row["step"]) for row in killed_rows) >= saved_step, "rows of steps past the checkpoint exist"

    status, output = finish(start([*args, f"ckpt_path={last}"]))
    assert status == 0, output[-3000:]
    assert_same_training_state(load_checkpoint(last), reference.checkpoint, global_step=EPOCHS * STEPS_PER_EPOCH)
    assert printed_test_metrics(output) == reference.test_metrics

    # metrics.csv: the killed run's rows up to the checkpoint, then the resumed run's: the reference's rows.
    rows = metrics_rows(out)
    before = [row for row in killed_rows if int(row["step"]) < saved_step]
    assert rows[: len(before)] == before
    assert rows == reference.rows  # the training-epoch means too: the checkpoint holds their sums
    assert tensorboard_scalars(out) == reference.scalars  # the killed run's events past the checkpoint cut off


# ---------------------------------------------------------------------------------------------
def test_training_resumed_in_the_same_folder_keeps_the_earlier_rows(corpus, tmp_path):
    """Stop after 6 steps, resume to 12 in the same folder: metrics.csv has the train rows of steps
    0-11 once each, the first run's rows up to its checkpoint unchanged but its row of the cut-short epoch 0, which
    the resumed run logs whole at the epoch's end, the validation columns that only the second run logged added to
    the header; TensorBoard has each scalar of steps 0-11 once."""
    every_3 = "callbacks.last_checkpoint_steps.every_n_train_steps=3"
    first = lm_overrides(corpus, "trainer.max_steps=6", "test=false", every_3)
    train(compose_config("train", first, tmp_path))
    first_rows = metrics_rows(tmp_path)
    assert sorted({int(row["step"]) for row in first_rows}) == list(range(6))
    assert not any(key.startswith("val/") for row in first_rows for key in row)

    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 6
    second = lm_overrides(corpus, "trainer.max_steps=12", "test=false", every_3, f"ckpt_path={last}")
    train(compose_config("train", second, tmp_path))
    rows = metrics_rows(tmp_path)
    partial = [row for row in first_rows if "train/loss_epoch" in row]
    assert [int(row["step"]) for row in partial] == [5], "the first run logged its 6 steps of epoch 0 at its stop"
    kept = [row for row in first_rows if row not in partial]  # the rows logged before its checkpoint
    assert rows[: len(kept)] == kept
    whole = [row for row in rows if "train/loss_epoch" in row]
    # epoch 0's row once, at its 8th step; epoch 1's 4 steps at the second run's stop (a run that ends keeps it)
    assert [(row["epoch"], row["step"]) for row in whole] == [("0", "7"), ("1", "11")]
    train_steps = [int(row["step"]) for row in rows if "train/loss_step" in row]
    assert train_steps == list(range(12))
    assert any("val/loss" in row for row in rows[len(first_rows) :]), "epoch 0 ended at step 8 with validation"
    scalars = tensorboard_scalars(tmp_path)
    assert sorted(step for tag, step in scalars if tag == "train/loss_step") == list(range(12))
    twice = {key: values for key, values in scalars.items() if len(values) > 1 and key[0] != "epoch"}
    assert not twice, "no scalar logged twice at one step (but `epoch`, which every row of a step holds)"


def _log(logger: ResumableCSVLogger, steps: range, **metrics: float) -> None:
    for step in steps:
        logger.log_metrics({name: value + step for name, value in metrics.items()}, step=step)
    logger.finalize("success")


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_csv_logger_replaces_the_rows_of_repeated_steps_and_widens_the_header(tmp_path):
    _log(ResumableCSVLogger(tmp_path, name="csv", version=""), range(5), loss=1.0)
    logger = ResumableCSVLogger(tmp_path, name="csv", version="")
    _log(logger, range(3, 6), loss=10.0, acc=0.5)  # resumed at step 3, with a new column
    path = tmp_path / "csv" / "metrics.csv"
    assert path.read_text().splitlines()[0] == "acc,loss,step"
    assert _rows(path) == [
        {"acc": "", "loss": "1.0", "step": "0"},
        {"acc": "", "loss": "2.0", "step": "1"},
        {"acc": "", "loss": "3.0", "step": "2"},
        {"acc": "3.5", "loss": "13.0", "step": "3"},
        {"acc": "4.5", "loss": "14.0", "step": "4"},
        {"acc": "5.5", "loss": "15.0", "step": "5"},
    ]
    assert logger.experiment.resumed and logger.experiment.replaced_rows == 2


def test_csv_logger_drops_a_row_cut_short_by_a_kill(tmp_path):
    _log(ResumableCSVLogger(tmp_path, name="", version=""), range(3), loss=1.0)
    path = tmp_path / "metrics.csv"
    path.write_text(path.read_text() + "3.0,")  # a kill in the middle of writing the row of step 3
    _log(ResumableCSVLogger(tmp_path, name="", version=""), range(4, 6), loss=5.0)
    assert [(row["loss"], row["step"]) for row in _rows(path)] == [
        ("1.0", "0"),
        ("2.0", "1"),
        ("3.0", "2"),
        ("9.0", "4"),
        ("10.0", "5"),
    ]
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777, "the mode of a plainly written file"


def test_csv_logger_in_a_new_folder_behaves_like_lightnings(tmp_path):
    logger = ResumableCSVLogger(tmp_path, name="csv", version="")
    _log(logger, range(2), loss=1.0)
    assert (tmp_path / "csv" / "metrics.csv").read_text().splitlines() == ["loss,step", "1.0,0", "2.0,1"]
    assert not logger.experiment.resumed


def test_loggers_cut_back_to_the_checkpoints_position_and_drop_repeats(tmp_path):
    """A checkpoint taken after step 2 records the loggers' positions; the killed run logs steps 3-4 (and step 2
    again, a repeat that is dropped); a new run resumed from those positions logs steps 3-5: each logger holds
    steps 0-5 once, the resumed run's values from step 3."""
    from moekit.loggers import ResumableTensorBoardLogger
    from resume_helpers import tensorboard_scalars

    def loggers():
        return [
            ResumableCSVLogger(tmp_path, name="csv", version=""),
            ResumableTensorBoardLogger(tmp_path, name="tensorboard", version="", default_hp_metric=False),
        ]

    killed = loggers()
    for step in range(5):
        for logger in killed:
            logger.log_metrics({"loss": float(step)}, step=step)
            logger.log_metrics({"loss": float(step)}, step=step)  # the same row again: dropped
        if step == 2:
            positions = {logger.log_dir: logger.position() for logger in killed}
    for logger in killed:
        logger.save()
    assert _rows(tmp_path / "csv" / "metrics.csv")[-1] == {"loss": "4.0", "step": "4"}

    resumed = loggers()
    for logger in resumed:
        logger.resume_from(positions[logger.log_dir])
        for step in range(3, 6):
            logger.log_metrics({"loss": 10.0 * step}, step=step)
        logger.finalize("success")
    expected = [0.0, 1.0, 2.0, 30.0, 40.0, 50.0]
    assert [float(row["loss"]) for row in _rows(tmp_path / "csv" / "metrics.csv")] == expected
    scalars = tensorboard_scalars(tmp_path)
    assert {step: values for (tag, step), values in scalars.items()} == {s: [v] for s, v in enumerate(expected)}
