"""predict.py on folders that hold files which are not images (a truncated download, macOS ``._*`` forks)."""

import csv

import numpy as np
import pytest
import torch
from PIL import Image

import moekit.commands.predict as predict_command
from conftest import TINY_NET, compose_config
from moekit.tasks import ImageClassifier


@pytest.fixture
def tiny_task(monkeypatch):
    torch.manual_seed(0)
    task = ImageClassifier(net=TINY_NET, num_classes=10).eval()
    monkeypatch.setattr(predict_command, "load_task", lambda path: task)
    return task


def _folder(tmp_path, good: int, bad: int):
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(good):
        Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(folder / f"{i}.png")
    for i in range(bad):
        (folder / f"._{i}.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble resource fork")
    return folder


def test_predict_skips_unreadable_files_and_writes_the_rest(tiny_task, tmp_path, caplog):
    folder = _folder(tmp_path, good=3, bad=1)
    cfg = compose_config("predict", ["ckpt_path=x.ckpt", f"inputs={folder}", "top_k=10"], tmp_path / "out")
    rows = predict_command.predict(cfg)
    files = sorted({row["file"] for row in rows})
    assert files == [str(folder / f"{i}.png") for i in range(3)]
    assert "._0.png" in caplog.text and "skipped" in caplog.text
    for file in files:
        mine = [row for row in rows if row["file"] == file]
        assert [row["rank"] for row in mine] == list(range(1, 11))
        assert sum(row["probability"] for row in mine) == pytest.approx(1.0, abs=1e-5)
        assert [row["probability"] for row in mine] == sorted((row["probability"] for row in mine), reverse=True)
    with open(tmp_path / "out" / "predictions.csv", newline="") as file:
        assert len(list(csv.DictReader(file))) == 30


def test_predict_with_no_readable_image_names_the_inputs(tiny_task, tmp_path):
    folder = _folder(tmp_path, good=0, bad=2)
    cfg = compose_config("predict", ["ckpt_path=x.ckpt", f"inputs={folder}"], tmp_path / "out")
    with pytest.raises(ValueError, match=r"none of its 2 image file\(s\) could be read.*\._0\.png"):
        predict_command.predict(cfg)
