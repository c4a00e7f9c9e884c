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
