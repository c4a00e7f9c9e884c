"""The training template end to end on a tiny fake Fashion-MNIST: configs, fast_dev_run of every
experiment, train -> eval, resume, fine-tuning, upcycling, export, few-shot probe, bad input."""

from __future__ import annotations

import csv
import json
import math
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.logger import DummyLogger
from omegaconf import OmegaConf
from PIL import Image

import moekit.models  # noqa: F401  (registers the models with timm)
from conftest import CONFIGS, REPO, compose_config, run_script, small_overrides
from moekit.checkpoint import CheckpointError, load_task
from moekit.commands.common import where
from moekit.commands.evaluate import evaluate
from moekit.commands.export import export
from moekit.commands.predict import predict
from moekit.commands.probe import linear_probe
from moekit.commands.train import train
from moekit.configs import check_composed, compose
from moekit.data import FASHION_MNIST_CLASSES
from moekit.moe import MoELayer, TopKMoE, kernel_choices
from moekit.recipes import resolve_recipe
from moekit.tasks import ImageClassifier
from moekit.tasks.fewshot import fewshot_linear_probe, fit_ridge_probe
from resume_helpers import metrics_rows

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml") if not p.stem.endswith("_lm"))
SMALL_EXPERIMENTS = [e for e in EXPERIMENTS if "imagenet" not in e]


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(experiment, fake_fashion, tmp_path):
    overrides = [f"experiment={experiment}"]
    if "imagenet" in experiment:
        # the S/16 recipe's 128 experts x 6 layers hold ~0.9 B parameters: build a narrow copy of it
        overrides += [f"data.root={_image_folder(tmp_path)}", "data.num_classes=3", "moe.num_experts=4"]
    else:
        overrides += [f"data.root={fake_fashion}"]
    cfg = compose_config("train", overrides, tmp_path)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.task, net=cfg.model, _recursive_=False)
    assert isinstance(module, ImageClassifier)
    assert module.net.num_classes == datamodule.num_classes
    moe = [m for m in module.net.modules() if isinstance(m, MoELayer)]
    if "dense" in experiment:
        assert not moe
    else:
        depth = len(module.net.blocks)
        assert len(moe) == depth - depth // 2, "MoE in the second half of the blocks"
    for key in ("seed", "paths", "trainer", "ckpt_path"):
        assert key in cfg


@pytest.mark.e2e
def test_early_stopping_stops_when_validation_stops_improving(fake_fashion, tmp_path):
    """``callbacks=[default,early_stopping]`` with patience 1 and a learning rate of ~0 (validation never
    improves): the run stops after two validations of its 6 epochs."""
    overrides = small_overrides(fake_fashion, epochs=6) + [
        "callbacks=[default,early_stopping]",
        "callbacks.early_stopping.patience=1",
        "task.optimizer.lr=1e-12",
        "test=false",
    ]
    train(compose_config("train", overrides, tmp_path))
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["epoch"] == 1, "stopped after epoch 1 (0-based), the second validation without improvement"


def test_machine_settings_in_configs_local_default_are_composed(tmp_path):
    """configs/local/default.yaml (ignored by git) applies to every train run when it exists. Tried on a copy of
    configs/, so a developer's own local settings and the tests running beside this one are left alone."""
    configs = shutil.copytree(CONFIGS, tmp_path / "configs")
    (configs / "local" / "default.yaml").unlink(missing_ok=True)
    assert compose(configs, "train", [], tmp_path).paths.data_dir != "/machine/data"
    (configs / "local" / "default.yaml").write_text("# @package _global_\npaths:\n  data_dir: /machine/data\n")
    assert compose(configs, "train", [], tmp_path).paths.data_dir == "/machine/data"


def _shell_words(command: str) -> list[str]:
    """The words the shell passes (quotes removed), or the whitespace-split words of a line it would not take as it is
    (one continued on the next line)."""
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _documented_train_commands() -> list[str]:
    """The single runs ``python scripts/train.py ...`` the README and docs/ show, each once (no sweeps, no
    ``<placeholder>``, no command continued on the next line)."""
    lines = [
        line
        for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for line in doc.read_text().splitlines()
    ]
    start = "python scripts/train.py "
    commands = [
        _shell_words(line[line.index(start) :].split("#")[0].split("`")[0])[2:] for line in lines if start in line
    ]
    usable = [
        words for words in commands if "-m" not in words and not any("<" in w or "..." in w or w == "\\" for w in words)
    ]
    return sorted({" ".join(words) for words in usable})


@pytest.mark.parametrize("command", _documented_train_commands())
def test_each_documented_train_command_builds_its_model(command, tmp_path):
    """What the README and docs tell users to type composes, passes the config checks and builds the model it
    describes: MoE layers of the recipe named, none for ``moe=none``."""
    overrides = command.split()
    cfg = compose_config("train", overrides, tmp_path)
    check_composed(cfg, overrides)
    spec = resolve_recipe(OmegaConf.to_container(cfg.moe))
    layers = [m for m in instantiate(cfg.model).modules() if isinstance(m, MoELayer)]
    assert spec is None or "moe=none" not in overrides, "moe=none composes no recipe"
    if spec is None:
        assert not layers, "no recipe (moe=none, a dense experiment): no MoE layer"
    else:
        assert layers and all(layer.num_experts == spec["num_experts"] for layer in layers)
        if "moe=switch" in overrides:
            assert all(isinstance(layer, TopKMoE) and layer.top_k == 1 for layer in layers)


@pytest.mark.parametrize("experiment", SMALL_EXPERIMENTS)
@pytest.mark.e2e
def test_fast_dev_run_of_each_experiment(experiment, fake_fashion, tmp_path):
    cfg = compose_config(
        "train",
        [
            f"experiment={experiment}",
            f"data.root={fake_fashion}",
            "data.batch_size=16",
            "data.val_size=64",
            "debug=fdr",
        ],
        tmp_path,
    )
    metrics = train(cfg)
    assert 0.0 <= metrics["test/acc"] <= 1.0 and (metrics["test/acc"] * 16) % 1 == pytest.approx(0.0, abs=1e-5), (
        "one test batch of 16 images: a whole number of them right"
    )
    aux = {key.removeprefix("train/aux/").removesuffix("_step") for key in metrics if key.startswith("train/aux/")}
    aux = {name.removesuffix("_epoch") for name in aux}
    recipe = cfg.moe or {}
    weighted = {name for name in ("switch", "importance", "load", "z") if recipe.get(f"{name}_loss_weight")}
    assert aux - {"total"} == weighted, "the recipe's auxiliary losses, and only those, are trained and logged"
    total = metrics.get("train/aux/total_step", 0.0)
    assert metrics["train/loss_step"] == pytest.approx(metrics["train/ce_step"] + total, rel=1e-5, abs=1e-6), (
        "the training loss is the cross-entropy plus the auxiliary losses"
    )


@pytest.mark.e2e
def test_a_runs_kernel_choices_are_set_and_recorded(fake_fashion, tmp_path):
    """``kernel_choices`` of the config are set before the model is built, and the run record names them."""
    cfg = compose_config(
        "train",
        [
            f"data.root={fake_fashion}",
            "data.val_size=64",
            "debug=tiny",
            "trainer.fast_dev_run=true",
            "moe=top2",
            "kernel_choices=['ROW_BLOCK=32','AUTO_KERNELS[cpu,ragged]=grouped_mm']",
        ],
        tmp_path,
    )
    train(cfg)
    assert kernel_choices.ROW_BLOCK == 32 and kernel_choices.AUTO_KERNELS["cpu", "ragged"] == "grouped_mm"
    record = json.loads((Path(cfg.paths.output_dir) / "results.json").read_text())
    assert record["kernel_choices"] == ["AUTO_KERNELS[cpu,ragged]=grouped_mm", "ROW_BLOCK=32"]
    cfg.kernel_choices, cfg.paths.output_dir = [], str(tmp_path / "next")  # the next run in this process: as shipped
    train(cfg)
    assert json.loads((tmp_path / "next" / "results.json").read_text())["kernel_choices"] == []


def test_the_end_of_run_summary_names_only_what_the_run_wrote(tmp_path):
    checkpoints = SimpleNamespace(dirpath=str(tmp_path / "checkpoints"), best_model_path="")
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), loggers=[DummyLogger()], checkpoint_callback=checkpoints)
    assert where(trainer) == f"outputs: {tmp_path}", "fast_dev_run: no logger folder, no checkpoint written"
    (tmp_path / "checkpoints").mkdir()
    logger = CSVLogger(tmp_path)
    trainer.loggers, checkpoints.best_model_path = [logger], "best.ckpt"
    assert where(trainer).splitlines()[1:] == [
        f"  CSVLogger: {logger.log_dir}",
        f"  checkpoints: {tmp_path / 'checkpoints'}",
        "  best checkpoint: best.ckpt",
    ]


@pytest.mark.e2e
def test_fast_dev_run_of_the_imagenet_recipe(tmp_path):
    cfg = compose_config(
        "train",
        [
            "experiment=soft_moe_vit_s16_imagenet",
            f"data.root={_image_folder(tmp_path)}",
            "data.num_classes=3",
            "data.batch_size=2",
            "data.num_workers=0",
            "data.pin_memory=false",
            "debug=fdr",
            "+model.depth=2",
            "moe.num_experts=8",
        ],
        tmp_path / "run",
    )
    metrics = train(cfg)
    assert "test/acc" in metrics


def _image_folder(root: Path) -> Path:
    from PIL import Image

    for split in ("train", "val"):
        for label in range(3):
            folder = root / "images" / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(2):
                Image.new("RGB", (40, 40), color=(80 * label, 10 * i, 50)).save(folder / f"{i}.png")
    return root / "images"


# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(fake_fashion, tmp_path_factory):
    """One short training run shared by the checkpoint tests."""
    out = tmp_path_factory.mktemp("run")
    cfg = compose_config("train", small_overrides(fake_fashion, epochs=2), out)
    metrics = train(cfg)
    return out, metrics


@pytest.mark.e2e
def test_train_then_eval_gives_the_same_test_metric(trained_run, tmp_path):
    out, metrics = trained_run
    best = sorted((out / "checkpoints").glob("epoch_*.ckpt"))[-1]
    cfg = compose_config("eval", [f"ckpt_path={best}", "logger=csv"], tmp_path)
    again = evaluate(cfg)
    assert again["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert again["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-5)


@pytest.mark.e2e
def test_resume_continues_from_the_saved_step(trained_run, fake_fashion, tmp_path):
    out, _ = trained_run
    last = out / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    steps_per_epoch = saved["global_step"] // 2
    assert saved["epoch"] == 1 and steps_per_epoch > 0
    cfg = compose_config(
        "train", small_overrides(fake_fashion, epochs=3) + [f"ckpt_path={last}", "test=false"], tmp_path
    )
    train(cfg)
    resumed = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert resumed["global_step"] == 3 * steps_per_epoch, "one more epoch on top of the saved two"
    first_state = saved["optimizer_states"][0]["state"]
    resumed_state = resumed["optimizer_states"][0]["state"]
    key = next(iter(first_state))
    assert int(resumed_state[key]["step"]) == int(first_state[key]["step"]) + steps_per_epoch
    assert resumed["lr_schedulers"][0]["last_epoch"] == 3 * steps_per_epoch
    logged = {int(float(row["epoch"])) for row in metrics_rows(tmp_path) if "epoch" in row}
    assert logged == {2}, "a resumed run trains the one epoch left, not all three from the start"


@pytest.mark.e2e
def test_finetune_from_a_checkpoint_with_a_new_head(trained_run):
    out, _ = trained_run
    ckpt = out / "checkpoints" / "last.ckpt"
    source = load_task(str(ckpt))
    net_cfg = dict(source.hparams["net"], num_classes=5)
    module = ImageClassifier(net=net_cfg, num_classes=5, init_from=str(ckpt), freeze_backbone=True)
    for name, value in module.net.state_dict().items():
        if not name.startswith("head."):
            torch.testing.assert_close(value, source.net.state_dict()[name], msg=name)
    assert module.net.head.weight.shape == (5, source.net.embed_dim)
    trainable = {n for n, p in module.net.named_parameters() if p.requires_grad}
    assert trainable == {"head.weight", "head.bias"}


@pytest.mark.e2e
def test_finetune_from_an_incompatible_checkpoint_names_the_keys(trained_run):
    out, _ = trained_run
    source = load_task(str(out / "checkpoints" / "last.ckpt"))
    net_cfg = dict(source.hparams["net"], embed_dim=48)
    with pytest.raises(CheckpointError, match=r"shape mismatch: .*pos_embed|blocks\.0"):
        ImageClassifier(net=net_cfg, num_classes=10, init_from=str(out / "checkpoints" / "last.ckpt"))


def test_upcycled_task_reproduces_the_dense_vit(tmp_path):
    dense_cfg = {
        "_target_": "moekit.models.create_model",
        "model_name": "vit_tiny_patch4_28",
        "embed_dim": 32,
        "depth": 2,
        "num_heads": 2,
        "stem": "conv",
    }
    dense = ImageClassifier(net=dense_cfg, num_classes=10).eval()
    path = tmp_path / "dense.pt"
    torch.save(dense.net.state_dict(), path)
    moe_cfg = dict(
        dense_cfg,
        model_name="top2_moe_vit_tiny_patch4_28",
        moe={"num_experts": 4, "capacity_factor": None, "eval_capacity_factor": None},
    )
    moe = ImageClassifier(net=moe_cfg, num_classes=10, init_from=str(path), init_mode="upcycle").eval()
    assert any(isinstance(m, TopKMoE) for m in moe.net.modules())
    images = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(moe(images), dense(images), rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
def test_export_loads_in_timm_and_equals_the_trained_model(trained_run, tmp_path):
    out, _ = trained_run
    ckpt = out / "checkpoints" / "last.ckpt"
    cfg = compose_config("export", [f"ckpt_path={ckpt}", f"output_path={tmp_path / 'model.safetensors'}"], tmp_path)
    path = export(cfg)
    task = load_task(str(ckpt)).eval()
    overrides = {k: v for k, v in task.hparams["net"].items() if not k.startswith("_") and k != "model_name"}
    model = timm.create_model(
        task.hparams["net"]["model_name"], pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **overrides
    ).eval()
    images = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(model(images), task.net(images))


@pytest.mark.e2e
def test_fewshot_linear_probe_runs_on_a_checkpoint(trained_run, tmp_path):
    out, _ = trained_run
    cfg = compose_config("linear_probe", [f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}", "shots=3"], tmp_path)
    accuracy = linear_probe(cfg)
    # the fake images follow one template per class: 3 examples a class separate them far above chance (0.1)
    assert accuracy > 0.5
    task = load_task(str(out / "checkpoints" / "last.ckpt"))
    datamodule = instantiate(OmegaConf.create(task.hparams["run_config"]["data"]), _convert_="all")
    again = fewshot_linear_probe(task.net, datamodule, shots=3, seed=0)
    assert accuracy == again.accuracy, "the command probes the checkpoint's network on its own data"


def test_ridge_probe_leave_one_out_matches_refitting():
    torch.manual_seed(0)
    features = torch.randn(12, 4)
    labels = torch.arange(12) % 3
    _, mean, std, l2, loo = fit_ridge_probe(features, labels, 3, l2_grid=(0.5,))
    # explicit leave-one-out: refit without each example
    x = torch.cat([((features.double() - mean) / std), torch.ones(12, 1, dtype=torch.float64)], 1)
    y = -torch.ones(12, 3, dtype=torch.float64)
    y[torch.arange(12), labels] = 1
    hits = 0
    for i in range(12):
        keep = torch.arange(12) != i
        w = torch.linalg.solve(x[keep].t() @ x[keep] + 0.5 * torch.eye(5, dtype=torch.float64), x[keep].t() @ y[keep])
        hits += int((x[i] @ w).argmax() == labels[i])
    assert loo == pytest.approx(hits / 12)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (["model.model_name=soft_moe_vit_huge"], ValueError, "unknown model_name='soft_moe_vit_huge'"),
        (["+model.patch_size=5", "model.stem=patch"], ValueError, "not divisible"),
        (["model.moe_blocks=[0,1,2,3,4,5,6]"], ValueError, "block"),
        (["data.root=/nonexistent/fashion"], ValueError, "/nonexistent/fashion"),
        (["ckpt_path=/nonexistent/last.ckpt"], CheckpointError, "does not exist"),
    ],
)
@pytest.mark.e2e
def test_bad_input_raises_a_clear_error(overrides, error, match, fake_fashion, tmp_path):
    cfg = compose_config("train", small_overrides(fake_fashion) + overrides, tmp_path)
    with pytest.raises(error, match=match):
        train(cfg)


def test_corrupt_checkpoint_is_a_clear_error_and_stays_untouched(tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match="not a moekit training checkpoint"):
        load_task(str(bad))
    assert bad.read_bytes() == b"PK\x03\x04 truncated"


# The command-line bad-input cases (unknown experiment, missing checkpoint, ...) are in test_bad_input.py.


def job_folder(sweep: Path, override: str) -> Path:
    """The folder of the sweep job whose overrides include ``override`` (named by its overrides)."""
    (job,) = [
        p.parent.parent for p in sweep.glob("**/.hydra/overrides.yaml") if override in p.parent.parent.name.split(",")
    ]
    return job


def sweep_experts(data_root: Path, log_dir: Path, values: str, *extra: str):
    """``scripts/train.py -m moe.num_experts=<values>``, one fast_dev_run per value."""
    overrides = [f"data.root={data_root}", "data.val_size=64", "debug=tiny", "trainer.fast_dev_run=true", *extra]
    return run_script("train.py", "-m", f"moe.num_experts={values}", *overrides, f"paths.log_dir={log_dir}", cwd=REPO)


@pytest.mark.e2e
def test_cli_multirun_sweeps_the_number_of_experts(fake_fashion, tmp_path):
    result = sweep_experts(fake_fashion, tmp_path, "2,4")
    assert result.returncode == 0, result.stderr[-2000:]
    (sweep,) = tmp_path.glob("train/multiruns/*")
    for value in (2, 4):  # each job in a folder named by its setting (data.root and paths.log_dir left out)
        job = job_folder(sweep, f"moe.num_experts={value}")
        assert job.name == f"data.val_size=64,debug=tiny,moe.num_experts={value},trainer.fast_dev_run=True"
        assert f"moe.num_experts={value}" in (job / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.e2e
def test_a_sweep_runs_every_job_past_a_failure_and_exits_1_with_a_summary(fake_fashion, tmp_path):
    result = sweep_experts(fake_fashion, tmp_path, "2,0,4")
    assert result.returncode == 1, result.stderr[-2000:]
    (sweep,) = tmp_path.glob("train/multiruns/*")
    assert all((job_folder(sweep, f"moe.num_experts={n}") / "results.json").is_file() for n in (2, 4)), "the 4 job ran"
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert summary["jobs"] == 3 and summary["succeeded"] == 2
    (failed,) = summary["failed"]
    assert failed["job"] == job_folder(sweep, "moe.num_experts=0").name
    assert "moe.num_experts=0" in failed["overrides"] and "num_experts" in failed["error"]
    assert "sweep: 1 of 3 jobs failed" in result.stderr + result.stdout

    # Rerun into its folder without the failing value, the others in another order: both found and skipped, and the
    # earlier failure, not part of this sweep, is not reported again.
    rerun = sweep_experts(fake_fashion, tmp_path, "4,2", f"hydra.sweep.dir={sweep}")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert summary["jobs"] == 2 and summary["failed"] == [] and len(summary["skipped"]) == 2


@pytest.mark.e2e
def test_predict_gives_the_test_loaders_probabilities_with_class_names(trained_run, tmp_path):
    """Test images saved as PNG files, classified by scripts/predict.py: the probabilities of the test loader's
    forward (same preprocessing), Fashion-MNIST's class names from the checkpoint, and the same rows in the CSV."""
    out, _ = trained_run
    ckpt = out / "checkpoints" / "last.ckpt"
    task = load_task(str(ckpt))
    datamodule = instantiate(OmegaConf.create(task.hparams["run_config"]["data"]), _convert_="all")
    datamodule.setup("test")
    folder = tmp_path / "images"
    folder.mkdir()
    raw = datamodule.test_set.images[:5]  # uint8 [5, 1, 28, 28]
    for i, image in enumerate(raw):
        Image.fromarray(image[0].numpy()).save(folder / f"{i}.png")
    with torch.inference_mode():
        expected = task(datamodule.test_set.transform(raw)).softmax(-1).topk(3, dim=-1)

    cfg = compose_config("predict", [f"ckpt_path={ckpt}", f"inputs={folder}", "top_k=3"], tmp_path / "out")
    rows = predict(cfg)
    assert [row["file"] for row in rows[::3]] == [str(folder / f"{i}.png") for i in range(5)]
    assert [row["label"] for row in rows] == expected.indices.flatten().tolist()
    assert [row["probability"] for row in rows] == pytest.approx(expected.values.flatten().tolist(), abs=1e-6)
    assert {row["class"] for row in rows} <= set(FASHION_MNIST_CLASSES)
    with open(tmp_path / "out" / "predictions.csv", newline="") as file:
        written = list(csv.DictReader(file))
    assert [(r["file"], int(r["label"]), r["class"]) for r in written] == [
        (r["file"], r["label"], r["class"]) for r in rows
    ]

    glob_cfg = compose_config("predict", [f"ckpt_path={ckpt}", f"inputs='{folder}/[01].png'"], tmp_path / "glob")
    assert len(predict(glob_cfg)) == 2 * 5  # two images, top-5
    empty = compose_config("predict", [f"ckpt_path={ckpt}", f"inputs={tmp_path / 'out'}"], tmp_path / "none")
    with pytest.raises(ValueError, match="no image there"):
        predict(empty)


@pytest.mark.e2e
def test_every_run_ends_with_a_routing_report(trained_run):
    """routing_report.md / .png and results.json's ``routing``: per MoE layer, shares summing to 1 over its experts
    and figures that follow from them (unused experts, max / mean, effective experts), over the 64 test images."""
    out, _ = trained_run
    record = json.loads((out / "results.json").read_text())
    routing = record["routing"]
    report = (out / "routing_report.md").read_text()
    assert routing and (out / "routing_report.png").stat().st_size > 0
    for name, layer in routing.items():
        load = torch.tensor(layer["expert_load"], dtype=torch.float64)
        assert f"`{name}`" in report and len(load) == layer["experts"]
        assert load.sum().item() == pytest.approx(1.0)
        assert layer["unused_experts"] == int((load == 0).sum())
        assert layer["max_over_mean"] == pytest.approx(load.max().item() * len(load))
        assert 1.0 <= layer["effective_experts"] <= len(load) + 1e-9
        assert layer["tokens"] == 64 * 49  # Soft MoE: the 49 patch tokens of each test image
        assert set(layer["top_class"]) <= set(FASHION_MNIST_CLASSES) and len(layer["top_class"]) == len(load)
        assert all(0.1 <= share <= 1.0 for share in layer["top_class_share"])  # at least 1 / (10 classes)


def test_routing_figures_and_collapse_follow_from_the_expert_shares():
    from moekit.callbacks.routing_report import layer_routing

    even = layer_routing(torch.full((8,), 1 / 8), {"router_entropy": 2.0}, tokens=80)
    assert (even.unused_experts, even.load_cv, even.max_over_mean) == (0, pytest.approx(0.0), pytest.approx(1.0))
    assert even.effective_experts == pytest.approx(8.0) and even.router_entropy == 2.0 and not even.collapsed
    two = layer_routing(torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0]), {"dropped_fraction": 0.25}, tokens=80)
    assert (two.unused_experts, two.max_over_mean, two.dropped_fraction) == (6, pytest.approx(4.0), 0.25)
    assert two.effective_experts == pytest.approx(2.0) and two.load_cv == pytest.approx(math.sqrt(3))
    assert two.collapsed  # 2 effective experts of 8: a quarter
    assert not layer_routing(torch.tensor([0.3, 0.3, 0.2, 0.2]), {}, tokens=4).collapsed


def _tiny_sweep(data_root: Path, sweep_dir: Path, *overrides: str):
    common = [f"data.root={data_root}", "data.val_size=64", "debug=tiny", "test=false", f"hydra.sweep.dir={sweep_dir}"]
    return run_script("train.py", "-m", "experiment=soft_moe_vit", *common, *overrides, cwd=REPO)


@pytest.mark.e2e
def test_optuna_search_reports_the_best_trials_validation_accuracy(fake_fashion, tmp_path):
    """``hparams_search=soft_moe_optuna`` with 3 trials: each trial is a run with its record, the trials' values
    are the sampled ones, and the reported best value is the largest best validation accuracy among the runs."""
    trials = ["hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.n_startup_trials=3"]
    result = _tiny_sweep(fake_fashion, tmp_path, "hparams_search=soft_moe_optuna", *trials)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/results.json"))]
    assert len(records) == 3
    for record in records:
        moe_cfg = record["config"]["moe"]
        assert moe_cfg["num_experts"] in (8, 16, 32) and moe_cfg["slots_per_expert"] in (1, 2, 4)
        assert 0.0005 <= record["config"]["task"]["optimizer"]["lr"] <= 0.01
    best = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert best.best_value == max(r["metrics"]["best_val"]["value"] for r in records)


@pytest.mark.e2e
def test_a_search_space_over_a_missing_key_stops_before_any_trial(fake_fashion, tmp_path):
    space = tmp_path / "configs" / "hparams_search"
    space.mkdir(parents=True)
    (space / "typo.yaml").write_text(
        "# @package _global_\ndefaults:\n  - soft_moe_optuna\nhydra:\n  sweeper:\n    params:\n"
        "      moe.num_expertz: choice(2, 4)\n"
    )
    search_path = f"hydra.searchpath=[file://{tmp_path / 'configs'}]"
    result = _tiny_sweep(fake_fashion, tmp_path / "sweep", "hparams_search=typo", search_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert "moe.num_expertz is not a setting of this config" in output and "did you mean moe.num_experts" in output
    assert not list((tmp_path / "sweep").glob("**/.hydra")), "no trial ran"


@pytest.mark.e2e
def test_submitit_local_launcher_runs_a_two_job_sweep(fake_fashion, tmp_path):
    result = _tiny_sweep(fake_fashion, tmp_path, "hydra/launcher=submitit_local", "moe.num_experts=4,8")
    assert result.returncode == 0, result.stderr[-3000:]
    experts = sorted(json.loads(p.read_text())["config"]["moe"]["num_experts"] for p in tmp_path.glob("*/results.json"))
    assert experts == [4, 8]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_sweep_rerun_into_its_folder_skips_the_finished_settings(fake_fashion, tmp_path):
    """The same sweep again with ``hydra.sweep.dir`` of the first: the job that finished is skipped (its record
    untouched, listed in the summary), the one that did not (no ``finished.json``: killed) runs;
    ``skip_finished=false`` reruns both."""
    sweep = ["trainer.fast_dev_run=true", "moe.num_experts=2,4"]
    assert _tiny_sweep(fake_fashion, tmp_path, *sweep).returncode == 0
    done, killed = job_folder(tmp_path, "moe.num_experts=2"), job_folder(tmp_path, "moe.num_experts=4")
    (killed / "finished.json").unlink()  # as if that job had been killed
    records = {job: (job / "results.json").stat().st_mtime_ns for job in (done, killed)}

    result = _tiny_sweep(fake_fashion, tmp_path, *sweep)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "sweep_summary.json").read_text())["skipped"] == [done.name]
    assert (done / "results.json").stat().st_mtime_ns == records[done], "the finished job did not run"
    assert (killed / "results.json").stat().st_mtime_ns > records[killed], "the unfinished job ran again"

    assert _tiny_sweep(fake_fashion, tmp_path, *sweep, "skip_finished=false").returncode == 0
    assert json.loads((tmp_path / "sweep_summary.json").read_text())["skipped"] == []
    assert (done / "results.json").stat().st_mtime_ns > records[done]


@pytest.mark.e2e
def test_mlflow_and_wandb_loggers_work_offline(fake_fashion, tmp_path, monkeypatch):
    """``logger=[csv,mlflow,wandb]``: MLflow's local SQLite store holds the same training losses as metrics.csv,
    step for step; W&B keeps an offline run in the run folder."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = small_overrides(fake_fashion) + ["logger=[csv,mlflow,wandb]", f"paths.log_dir={tmp_path / 'logs'}"]
    train(compose_config("train", overrides, tmp_path / "run"))
    with open(tmp_path / "run" / "csv" / "metrics.csv", newline="") as file:
        losses = [(int(r["step"]), float(r["train/loss_step"])) for r in csv.DictReader(file) if r["train/loss_step"]]
    client = MlflowClient(f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "train"]
    (run,) = client.search_runs([experiment.experiment_id])
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss_step")]
    assert losses and [step for step, _ in sorted(history)] == [step for step, _ in losses]
    assert [value for _, value in sorted(history)] == pytest.approx([value for _, value in losses])
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")), "an offline W&B run"


def test_a_logger_whose_package_is_missing_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"needs the wandb package.*pip install -e '\.\[loggers\]'"):
        check_composed(compose_config("train", ["logger=wandb"], tmp_path), [])


def test_an_mlflow_database_store_without_sqlalchemy_names_the_extra(monkeypatch, tmp_path):
    """mlflow-skinny has no SQLAlchemy, which the default SQLite store needs: refused before anything starts."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sqlalchemy" else find_spec(n, *a))
    with pytest.raises(ValueError, match=r"tracking_uri=sqlite:.*needs the sqlalchemy package.*\.\[loggers\]"):
        check_composed(compose_config("train", ["logger=mlflow"], tmp_path), [])
    check_composed(compose_config("train", ["logger=mlflow", "logger.mlflow.tracking_uri=file:./mlruns"], tmp_path), [])


def test_routing_report_counts_each_experts_tokens_by_the_class_of_their_image(tmp_path):
    """A top-1 layer (dropless) over 6 images of 5 tokens, labels 0-2: the report's main class of each expert and
    its share equal a count of the router's choices by label, done by hand."""
    from types import SimpleNamespace

    from moekit.callbacks import RoutingReport

    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=1).eval()
    net = torch.nn.Sequential(layer)
    net.num_classes = 3
    module = SimpleNamespace(net=net, class_names=["a", "b", "c"])
    trainer = SimpleNamespace(world_size=1, is_global_zero=True, datamodule=None)
    report = RoutingReport(str(tmp_path))
    report.on_test_epoch_start(trainer, module)
    x, labels = torch.randn(6, 5, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.no_grad():
        layer(x)
        expert_of_token = layer.router(x.reshape(30, 8)).expert_ids[:, 0]  # [30]
    report.on_test_batch_end(trainer, module, None, (x, labels), 0)
    report.on_test_epoch_end(trainer, module)

    counts = torch.zeros(3, 4)
    counts.index_put_((labels.repeat_interleave(5), expert_of_token), torch.ones(30), accumulate=True)
    routing = report.layers["0"]
    for expert in range(4):
        if counts[:, expert].sum():
            share, main = (counts[:, expert] / counts[:, expert].sum()).max(0)
            assert routing.top_class[expert] == "abc"[main] and routing.top_class_share[expert] == pytest.approx(share)
    assert "## The classes each expert serves" in (tmp_path / "routing_report.md").read_text()
    assert (tmp_path / "routing_classes.png").is_file()


@pytest.mark.e2e
def test_int8_experts_keep_the_test_accuracy_and_the_quantized_checkpoint_serves_eval_and_predict(
    trained_run, tmp_path
):
    """scripts/quantize.py on a trained checkpoint: int8 GPTQ experts change the test accuracy by at most half a
    point; eval.py and predict.py take the quantized file as ckpt_path."""
    from moekit.commands.quantize import quantize

    out, _ = trained_run
    ckpt = out / "checkpoints" / "last.ckpt"
    float_metrics = evaluate(compose_config("eval", [f"ckpt_path={ckpt}", "logger=csv"], tmp_path / "float"))
    cfg = compose_config(
        "quantize",
        [
            f"ckpt_path={ckpt}",
            "bits=8",
            "method=gptq",
            "calibration_batches=4",
            f"output_path={tmp_path}/q8.safetensors",
        ],
        tmp_path / "q",
    )
    path = quantize(cfg)
    quantized = evaluate(compose_config("eval", [f"ckpt_path={path}", "logger=csv"], tmp_path / "int8"))
    assert abs(quantized["test/acc"] - float_metrics["test/acc"]) <= 0.005
    assert quantized["test/loss"] == pytest.approx(float_metrics["test/loss"], rel=0.02)

    # predict.py on PNGs of test images: the quantized task's own probabilities, with the checkpoint's class names
    task = load_task(str(path))
    datamodule = instantiate(OmegaConf.create(task.hparams["run_config"]["data"]), _convert_="all")
    datamodule.setup("test")
    folder = tmp_path / "images"
    folder.mkdir()
    raw = datamodule.test_set.images[:3]
    for i, image in enumerate(raw):
        Image.fromarray(image[0].numpy()).save(folder / f"{i}.png")
    with torch.inference_mode():
        expected = task(datamodule.test_set.transform(raw)).softmax(-1).topk(5, dim=-1)
    rows = predict(compose_config("predict", [f"ckpt_path={path}", f"inputs={folder}"], tmp_path / "p"))
    assert [row["label"] for row in rows] == expected.indices.flatten().tolist()
    assert [row["probability"] for row in rows] == pytest.approx(expected.values.flatten().tolist(), abs=1e-6)
    assert {row["class"] for row in rows} <= set(FASHION_MNIST_CLASSES)


@pytest.mark.e2e
def test_bench_quant_prints_a_row_per_format_and_method(trained_run, capsys):
    from moekit.analysis.bench_quant import main

    out, _ = trained_run
    ckpt = out / "checkpoints" / "last.ckpt"
    main(["--ckpt", str(ckpt), "--formats", "int8", "ternary", "--calibration-batches", "4", "--rounds", "1"])
    table = capsys.readouterr().out.split("| experts |")[1].splitlines()[2:]
    assert [row.split("|")[1].strip() for row in table] == [
        "float32",
        "int8 rtn",
        "int8 gptq",
        "ternary rtn",
        "ternary gptq",
    ]
    float_row = table[0].split("|")
    assert float(float_row[3]) == 32.0 and float_row[6].strip() == "0.00%" and float_row[8].strip() == "1.00x"
    errors = [float(row.split("|")[6].strip().rstrip("%")) for row in table]
    assert errors[1] < errors[3] and errors[2] < errors[3], "int8 moves the logits less than ternary"
    bits = [float(row.split("|")[3]) for row in table[1:]]
    assert 8 < bits[0] == bits[1] < 9 and bits[2] < bits[0] / 3  # the tiny model's 32-row groups: 24 bits per 32
