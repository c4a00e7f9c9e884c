"""A researcher's own images end to end: an ImageNet-style folder of mixed files, a run trained on it, and the
inference and analysis scripts on its checkpoint and run records."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_results import PARETO, _results

from conftest import compose_config
from moekit.analysis.aggregate import metrics_of
from moekit.analysis.figures import plot_pareto
from moekit.analysis.records import RESULTS_FILE, archive_records, load_results
from moekit.commands.evaluate import evaluate
from moekit.commands.plot_slots import plot_slots
from moekit.commands.predict import predict
from moekit.commands.train import train
from moekit.data.imagefolder import imagefolder_split_dirs, read_rgb_image

CLASSES = ("cat", "dög", "red car")


def _write_folder(root: Path, classes=CLASSES, per_class: int = 4) -> Path:
    """``root/{train,val}/<class>/<i>.png``: small RGB images of two sizes, each class its own colour."""
    for split in ("train", "val"):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = np.full((20 + 4 * i, 24, 3), 60 * label + i, dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Soft MoE ViT trained on a 3-class image folder: (the folder, the run's last checkpoint)."""
    tmp = tmp_path_factory.mktemp("folder_run")
    root = _write_folder(tmp / "images")
    overrides = [
        "experiment=soft_moe_vit",
        "data=imagefolder",
        f"data.root={root}",
        "data.num_classes=3",
        "data.img_size=28",
        "data.num_workers=0",
        "data.batch_size=4",
        "data.auto_augment=null",
        "debug=tiny",
        "trainer.max_steps=1",
        "trainer.precision=32-true",
        "logger=csv",
        "test=false",
    ]
    train(compose_config("train", overrides, tmp / "run"))
    return root, tmp / "run" / "checkpoints" / "last.ckpt"


def test_a_folder_of_one_class_is_refused_naming_it(tmp_path):
    """One class folder: nothing to classify (torchmetrics would fail later on num_classes=1, naming no folder)."""
    root = _write_folder(tmp_path / "images", classes=("cat",))
    with pytest.raises(ValueError, match=rf"{root / 'train'} holds one class folder \('cat'\); a classifier needs"):
        imagefolder_split_dirs(root)


def test_16_bit_greyscale_images_keep_their_range(tmp_path):
    """A 16-bit PNG (mode I;16) and a 16-bit PGM (mode I) are scaled to 8 bits like PIL scales 16-bit colour
    (the high byte), not clipped at 255: PIL's own convert("RGB") would turn 1000 and 30000 into 255."""
    values = np.array([[0, 1000, 30000, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "grey16.png")
    (tmp_path / "grey16.pgm").write_bytes(b"P5\n4 1\n65535\n" + values.astype(">u2").tobytes())
    for name in ("grey16.png", "grey16.pgm"):
        rgb = np.asarray(read_rgb_image(str(tmp_path / name)))
        assert rgb.shape == (1, 4, 3)
        assert rgb[0, :, 0].tolist() == [0, 3, 117, 255], name  # v // 256
        assert (rgb == rgb[..., :1]).all()  # grey in all three channels


def test_eval_refuses_a_folder_whose_classes_are_not_the_checkpoints(folder_run, tmp_path):
    """The same number of classes under other names shifts the labels (sorted folder names): "kitten" sorts
    after "dög", so every cat would be scored as label 1. eval.py refuses; the checkpoint's own folder tests."""
    root, ckpt = folder_run
    other = _write_folder(tmp_path / "other", classes=("kitten", "dög", "red car"))
    data = ["data=imagefolder", "data.num_classes=3", "data.img_size=28", "data.num_workers=0", "data.batch_size=4"]
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", *data, f"data.root={other}", "logger=csv"], tmp_path / "e1")
    with pytest.raises(ValueError, match=r"\(0, 'cat', 'dög'\), \(1, 'dög', 'kitten'\)"):
        evaluate(cfg)
    same = compose_config("eval", [f"ckpt_path={ckpt}", *data, f"data.root={root}", "logger=csv"], tmp_path / "e2")
    assert 0.0 <= evaluate(same)["test/acc"] <= 1.0


def test_plot_slots_refuses_a_device_this_machine_lacks(folder_run, tmp_path):
    """Like predict.py: a clear ValueError before any work, not torch's error from moving the network."""
    _, ckpt = folder_run
    cfg = compose_config(
        "plot_slots", [f"ckpt_path={ckpt}", f"out={tmp_path / 's.png'}", "device=cuda:99"], tmp_path / "p"
    )
    with pytest.raises(ValueError, match=r"device=cuda:99 but this machine has"):
        plot_slots(cfg)
    assert not (tmp_path / "s.png").exists()


def test_a_sweep_run_with_test_false_is_tabulated_and_drawn_as_an_image_sweep(tmp_path):
    """Image runs that recorded validation metrics only: the table keeps the accuracy columns (not perplexity)
    and the Pareto figure is drawn without points instead of failing on an empty legend."""
    records = copy.deepcopy(PARETO)
    for record in records:
        record["metrics"] = {"val": {"acc": 0.8, "loss": 0.5}, "test": {}}
    runs = _results(records)
    assert [m.key for m in metrics_of(runs)] == ["acc", "acc_top5"]
    out = plot_pareto(runs, tmp_path / "pareto.png")
    assert Image.open(out).format == "PNG"


@pytest.mark.parametrize("content", ["[]", "null", "3"])
def test_a_results_json_that_is_not_an_object_is_named(tmp_path, content):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RESULTS_FILE).write_text(content)
    with pytest.raises(ValueError, match=r"run/results.json' is not a moekit run record \(TypeError: it holds a JSON"):
        load_results(tmp_path)


def test_the_trained_folder_run_records_its_classes(folder_run):
    """The checkpoint names its labels as the sorted class folders (what predict.py prints)."""
    _, ckpt = folder_run
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["moekit_class_names"] == ["cat", "dög", "red car"]


def test_predict_reads_every_kind_of_image_the_folder_run_trained_on(folder_run, tmp_path):
    """A nested folder of a PGM (a suffix torchvision's ImageFolder trains on), an RGBA PNG and a palette GIF, beside
    a note: each image gets its top-3 classes named as the class folders, probabilities summing to 1."""
    _, ckpt = folder_run
    inputs = tmp_path / "inputs"
    (inputs / "nested").mkdir(parents=True)
    Image.new("L", (30, 20), 90).save(inputs / "a.pgm")
    Image.new("RGBA", (16, 40), (200, 10, 10, 128)).save(inputs / "nested" / "b.png")
    Image.new("P", (28, 28), 3).save(inputs / "nested" / "c.gif")
    (inputs / "notes.txt").write_text("not an image")
    rows = predict(compose_config("predict", [f"ckpt_path={ckpt}", f"inputs={inputs}"], tmp_path / "out"))
    files = [str(inputs / "a.pgm"), str(inputs / "nested" / "b.png"), str(inputs / "nested" / "c.gif")]
    assert [row["file"] for row in rows] == [f for f in files for _ in range(3)]
    assert {row["class"] for row in rows} == set(CLASSES)
    for start in range(0, len(rows), 3):
        assert sum(row["probability"] for row in rows[start : start + 3]) == pytest.approx(1.0, abs=1e-5)
    with open(tmp_path / "out" / "predictions.csv", newline="") as file:
        assert [(r["file"], r["class"]) for r in csv.DictReader(file)] == [(r["file"], r["class"]) for r in rows]
    glob = compose_config("predict", [f"ckpt_path={ckpt}", f"inputs='{inputs}/*'"], tmp_path / "glob")
    assert [row["file"] for row in predict(glob)][::3] == files[:1], "a glob's matches filtered as a folder's files"


def test_archiving_into_a_file_is_refused_with_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RESULTS_FILE).write_text(json.dumps(PARETO[0]))
    (tmp_path / "archive.txt").write_text("notes")
    with pytest.raises(ValueError, match=r"archive.txt' is a file; give a folder"):
        archive_records(tmp_path / "run", tmp_path / "archive.txt")
    assert (tmp_path / "archive.txt").read_text() == "notes"
    assert archive_records(tmp_path / "run", tmp_path / "archive") == [tmp_path / "archive" / RESULTS_FILE]
