"""The progress bar: Lightning's rich bar (``rich`` is a dependency) with loss, accuracy and throughput."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger

from conftest import compose_config
from moekit.data.fashion_mnist import write_fake_fashion_mnist


@pytest.mark.e2e
def test_rich_progress_bar_shows_loss_accuracy_and_throughput(tmp_path):
    data_root = write_fake_fashion_mnist(tmp_path / "fashion-mnist", n_train=192, n_test=32)
    overrides = [
        f"data.root={data_root}",
        "data.val_size=64",
        "debug=tiny",
        "trainer.enable_progress_bar=true",
    ]
    cfg = compose_config("train", overrides, tmp_path / "run")
    callbacks = [instantiate(entry) for entry in cfg.callbacks.values()]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=CSVLogger(tmp_path / "logs"))
    trainer.fit(instantiate(cfg.task, net=cfg.model, _recursive_=False), datamodule=instantiate(cfg.data))
    assert isinstance(trainer.progress_bar_callback, RichProgressBar)
    shown = set(trainer.progress_bar_metrics)
    assert {"train/loss_step", "train/acc", "val/loss", "val/acc", "train/images_per_sec"} <= shown, shown


@pytest.mark.e2e
def test_progress_lines_every_n_steps_and_after_each_validation(tmp_path, caplog):
    """ProgressLog (``when=always``; by default only without a terminal): 4 steps per epoch, 2 epochs, a line at
    steps 2, 4, 6 and 8 with the
    loss, the throughput and the time left, and one with the validation metrics after each validation."""
    from moekit.callbacks import ProgressLog

    data_root = write_fake_fashion_mnist(tmp_path / "fashion-mnist", n_train=192, n_test=32)
    cfg = compose_config("train", [f"data.root={data_root}", "data.val_size=64", "debug=tiny"], tmp_path / "run")
    callbacks = [instantiate(entry) for entry in cfg.callbacks.values() if "ProgressLog" not in entry._target_]
    callbacks.append(ProgressLog(every_n_steps=2, when="always"))
    logger = CSVLogger(tmp_path / "logs")
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, max_epochs=2)
    with caplog.at_level("INFO", logger="moekit"):
        trainer.fit(instantiate(cfg.task, net=cfg.model, _recursive_=False), datamodule=instantiate(cfg.data))
    lines = [r.getMessage() for r in caplog.records if r.name == "moekit" and r.getMessage().startswith("epoch")]
    steps = [line for line in lines if "validation" not in line]
    assert [line.split()[3] for line in steps] == ["2/8", "4/8", "6/8", "8/8"], lines
    assert all("train/loss_step" in line and "train/images_per_sec" in line and "ETA" in line for line in steps)
    validations = [line for line in lines if "validation" in line]
    assert len(validations) == 2 and all("val/acc" in line for line in validations), lines


@pytest.mark.e2e
def test_console_prints_each_message_once_without_advertisements_or_deprecations(tmp_path):
    """``scripts/train.py`` with its output sent to a pipe: Lightning's messages once each (not also as
    ``INFO: ...``), no tip advertising a cloud logger, no library deprecation warning, moekit's summary in place of
    Lightning's, whose FLOPs read 0, and progress lines (no terminal: the rich bar draws nothing); no notice at each
    step checkpoint."""
    from resume_helpers import finish, start, train_command

    overrides = ["experiment=soft_moe_vit", "debug=tiny", f"paths.output_dir={tmp_path}", "test=false"]
    every_n = ["callbacks.progress_log.every_n_steps=5", "callbacks.last_checkpoint_steps.every_n_train_steps=7"]
    status, output = finish(start(train_command(*overrides, "trainer.max_epochs=2", *every_n)))
    assert status == 0, output[-3000:]
    assert output.count("Seed set to 42") == 1 and "INFO: " not in output
    assert "Tip:" not in output and "deprecated" not in output and "weights_only" not in output
    assert "FLOPs / image" in output and "Total FLOPs" not in output
    assert "step 5/20" in output and "step 20/20" in output and "validation: val/loss" in output


def test_progress_lines_with_gradient_accumulation_start_at_the_first_step_of_the_run(tmp_path, caplog):
    """2 micro-batches a step, a line every 2 steps: lines at steps 2 and 4, none at step 0 (the first micro-batch,
    before any optimizer step); a run resumed from step 2 logs step 4 only, not step 2 again."""
    import torch
    from lightning import LightningModule, Trainer

    from moekit.callbacks import ProgressLog

    class Task(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=2)

    def fit(max_steps: int, ckpt_path=None, save=None) -> list[str]:
        caplog.clear()
        trainer = Trainer(
            max_steps=max_steps,
            accumulate_grad_batches=2,
            logger=False,
            callbacks=[ProgressLog(every_n_steps=2, when="always")],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        with caplog.at_level("INFO", logger="moekit"):
            trainer.fit(Task(), ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
        lines = [r.getMessage() for r in caplog.records if r.name == "moekit" and r.getMessage().startswith("epoch")]
        return [line.split()[3] for line in lines]

    assert fit(4) == ["2/4", "4/4"]
    assert fit(2, save=tmp_path / "step2.ckpt") == ["2/2"]
    assert fit(4, ckpt_path=tmp_path / "step2.ckpt") == ["4/4"]


def test_progress_lines_on_data_of_no_length_show_no_total_and_no_time_left(caplog):
    """Streamed training data (an ``IterableDataset`` of no length) and no ``max_steps``: Lightning estimates -1 steps.
    The lines give the step alone, without a total or a time left (not ``step 2/-1  ETA -1:59:59``)."""
    import torch
    from lightning import LightningModule, Trainer
    from torch.utils.data import DataLoader, IterableDataset

    from moekit.callbacks import ProgressLog

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.randn(8, 4).unbind())

    class Task(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = Trainer(
        max_epochs=1, logger=False, callbacks=[ProgressLog(every_n_steps=2, when="always")], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with caplog.at_level("INFO", logger="moekit"):
        trainer.fit(Task(), DataLoader(Stream(), batch_size=2))
    assert trainer.estimated_stepping_batches == -1
    lines = [r.getMessage() for r in caplog.records if r.name == "moekit" and r.getMessage().startswith("epoch")]
    assert [line.split()[2:4] for line in lines] == [["step", "2"], ["step", "4"]], lines
    assert not any("ETA" in line or "/-1" in line for line in lines), lines


@pytest.mark.parametrize("every", [True, 0, 2.5, "10"])
def test_a_step_count_that_is_not_a_whole_number_is_refused(every):
    """``every_n_steps: true`` in a config is a typo, not one step: a bool is refused as the others are."""
    from moekit.callbacks import ProgressLog

    with pytest.raises(ValueError, match=rf"every_n_steps={every!r}; give a whole number of steps"):
        ProgressLog(every_n_steps=every)
