"""The capacity tuning demo (``scripts/tune_capacity_demo.py``): a run logged to metrics.csv alone (``debug=...``,
``logger=csv``) is read back; a run whose history could not be read back is refused before it trains."""

from __future__ import annotations

import pytest

from conftest import compose_config, small_overrides
from moekit.analysis.capacity_tuning import read_capacity_scalars, summarize_capacity_tuning
from moekit.commands import tune_capacity


def test_the_history_is_read_from_metrics_csv_without_tensorboard(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text(
        "capacity/blocks.1.mlp/drop_rate,capacity/blocks.1.mlp/factor,epoch,step,train/loss_step\n"
        ",,0,0,2.3\n"
        "0.5,0.5,,1,\n"
        "0.02,1.1,,3,\n"
    )
    history = read_capacity_scalars(tmp_path)
    assert history == {"blocks.1.mlp": {"drop_rate": [(1, 0.5), (3, 0.02)], "factor": [(1, 0.5), (3, 1.1)]}}
    assert "blocks.1.mlp" in summarize_capacity_tuning(history, 0.01)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["logger=wandb"],
            r"read back from TensorBoard or metrics.csv, but the run logs to \['moekit.loggers.WandbLogger'\]",
        ),
        (["~callbacks.capacity_tuner"], r"no callbacks.capacity_tuner"),
    ],
)
def test_a_run_whose_history_cannot_be_plotted_is_refused_before_training(tmp_path, monkeypatch, overrides, message):
    def no_training(cfg):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(tune_capacity, "train", no_training)
    cfg = compose_config("tune_capacity_demo", [f"paths.log_dir={tmp_path / 'logs'}", *overrides], tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        tune_capacity.tune_capacity_demo(cfg)


@pytest.mark.e2e
def test_a_debug_run_of_the_demo_draws_its_figure(tmp_path, fake_fashion):
    """``debug=tiny`` logs to metrics.csv only: the demo used to train, then fail (no TensorBoard scalars)."""
    overrides = [
        *small_overrides(fake_fashion),
        "trainer.limit_train_batches=6",
        "callbacks.capacity_tuner.window=2",
        "callbacks.capacity_tuner.update_every=2",
        f"figure={tmp_path / 'capacity.png'}",
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    cfg = compose_config("tune_capacity_demo", overrides, tmp_path / "out")
    assert tune_capacity.tune_capacity_demo(cfg).stat().st_size > 0
    history = read_capacity_scalars(tmp_path / "out")
    assert [step for step, _ in history["blocks.1.mlp"]["factor"]] == [1, 3, 5]
