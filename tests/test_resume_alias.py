"""ckpt_path=last / auto: the checkpoint (file or sharded folder) that loads with the most training progress (file times
only break ties), in this run's folder or the newest earlier run of the task (a sweep's job: its own folder only);
corrupt checkpoints are skipped and named; errors name the checkpoints that do exist, and a checkpoint of another task
is refused naming both."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, read_write

from conftest import compose_config, small_overrides
from moekit.checkpoint import SHARDED_METADATA, TASK_KEY, CheckpointError, check_ckpt_path, read_training_checkpoint
from moekit.commands.train import _resolve_resume_alias, train
from moekit.configs import instantiate
from moekit.resume import FIT_STARTED_KEY, check_resume_checkpoint, find_resume_checkpoint
from resume_helpers import metrics_rows


def write(
    path: Path, *, good: bool, age: float = 0.0, step: int | None = None, epoch: int = 0, started: float | None = None
) -> Path:
    """A minimal training checkpoint (or a truncated file), its modification time ``age`` seconds ago; ``step``:
    its ``global_step`` (None: without one); ``started``: when the process that wrote it started (None: unstamped, as
    an earlier moekit wrote them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if good:
        steps = {} if step is None else {"global_step": step}
        stamp = {} if started is None else {FIT_STARTED_KEY: started}
        torch.save({"state_dict": {}, "optimizer_states": [], "epoch": epoch, **steps, **stamp}, path)
    else:
        path.write_bytes(b"PK\x03\x04 truncated")
    stamp = path.stat().st_mtime - age
    os.utime(path, (stamp, stamp))
    return path


def write_sharded(folder: Path, *, age: float = 0.0, damage: str = "", step: int = 1) -> Path:
    """A sharded checkpoint folder laid out as FSDP's ``state_dict_type=sharded`` writes one (the shards and their
    index by torch.distributed.checkpoint, then rank 0's metadata file), written ``age`` seconds ago; ``damage``:
    ``shard`` cuts a shard short, ``metadata`` truncates the metadata file, ``no_metadata`` leaves it out; ``step``:
    the ``global_step`` its metadata holds."""
    with warnings.catch_warnings():  # one process, no process group: torch says it saves as a single process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": {"net.w": torch.ones(64, 64)}}, checkpoint_id=folder)
    if damage == "shard":
        shard = next(folder.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    if damage != "no_metadata":
        torch.save({"epoch": 0, "global_step": step}, folder / SHARDED_METADATA)
    if damage == "metadata":
        (folder / SHARDED_METADATA).write_bytes(b"PK\x03\x04 truncated")
    stamp = folder.stat().st_mtime - age
    for path in [folder, *folder.iterdir()]:
        os.utime(path, (stamp, stamp))
    return folder


@pytest.fixture
def runs(tmp_path) -> Path:
    runs = tmp_path / "logs" / "train" / "runs"
    write(runs / "2026-01-01_10-00-00" / "checkpoints" / "last.ckpt", good=True, age=100)
    write(runs / "2026-01-02_10-00-00" / "checkpoints" / "epoch_000.ckpt", good=True, age=20)
    write(runs / "2026-01-02_10-00-00" / "checkpoints" / "epoch_001.ckpt", good=False, age=10)
    write(runs / "2026-01-02_10-00-00" / "checkpoints" / "last.ckpt", good=False, age=10)
    (runs / "2026-01-03_10-00-00").mkdir()  # a run that died before its first checkpoint
    return runs


def test_last_is_the_newest_checkpoint_that_loads_of_the_newest_run_that_has_one(runs):
    found, skipped = find_resume_checkpoint("last", runs / "2026-01-04_10-00-00", runs)
    assert found == runs / "2026-01-02_10-00-00" / "checkpoints" / "epoch_000.ckpt"
    assert [p.name for p in skipped] == ["last.ckpt", "epoch_001.ckpt"], "newest first, last.ckpt first among equals"


def test_the_runs_own_checkpoints_come_first(runs):
    own = runs / "2026-01-01_10-00-00"  # hydra.run.dir pointed at an existing run
    assert find_resume_checkpoint("auto", own, runs)[0] == own / "checkpoints" / "last.ckpt"


def test_auto_starts_afresh_and_last_refuses_without_any_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    assert find_resume_checkpoint("auto", runs / "now", runs) == (None, [])
    with pytest.raises(CheckpointError, match="ckpt_path=last: no run of this task has a checkpoint.*ckpt_path=auto"):
        find_resume_checkpoint("last", runs / "now", runs)


def test_a_sweep_job_resumes_only_from_its_own_folder(runs, tmp_path):
    """A sweep's job (``runs_dir=None``) never resumes another setting's run, however new; its own checkpoint, yes."""
    job = tmp_path / "multiruns" / "2026-01-05_10-00-00" / "3"
    assert find_resume_checkpoint("auto", job, None) == (None, [])
    with pytest.raises(CheckpointError, match=f"this sweep job has no checkpoint \\({job}/checkpoints"):
        find_resume_checkpoint("last", job, None)
    write(job / "checkpoints" / "last.ckpt", good=True)
    assert find_resume_checkpoint("auto", job, None)[0] == job / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("mode", [RunMode.RUN, RunMode.MULTIRUN])
def test_train_looks_at_other_runs_only_outside_a_sweep(mode, fake_fashion, tmp_path):
    """A run resumes the newest of the runs beside it: a ``debug=`` run (``debug=tiny`` here) the debug runs, never
    a full run (newer here); a sweep's job none."""
    logs = tmp_path / "logs"
    earlier = write(logs / "debug" / "train" / "runs" / "2026-01-01_10-00-00" / "checkpoints" / "last.ckpt", good=True)
    write(logs / "train" / "runs" / "2026-01-01_11-00-00" / "checkpoints" / "last.ckpt", good=True)
    job = logs / ("debug/train/runs/2026-01-02_10-00-00" if mode == RunMode.RUN else "train/multiruns/2026-01-02/0")
    cfg = compose_config("train", [*small_overrides(fake_fashion, 1), f"paths.log_dir={logs}", "ckpt_path=auto"], job)
    with read_write(cfg.hydra):
        cfg.hydra.mode = mode
    HydraConfig.instance().set_config(cfg)
    try:
        _resolve_resume_alias(cfg, job)
    finally:
        HydraConfig.instance().cfg = None  # no sweep mode left behind for the tests after this one
    assert cfg.ckpt_path == (str(earlier) if mode == RunMode.RUN else None)


def test_sharded_checkpoint_folders_count_as_checkpoints(runs):
    """A newer run whose checkpoints are sharded folders (trainer=fsdp) is resumed, not the older run's file; its
    last.ckpt first, and ckpt_path=auto resumes a requeued job's own sharded checkpoint."""
    newest = runs / "2026-01-03_10-00-00" / "checkpoints"
    write_sharded(newest / "epoch_000.ckpt", age=5)
    write_sharded(newest / "last.ckpt", age=5)
    assert find_resume_checkpoint("last", runs / "2026-01-04_10-00-00", runs) == (newest / "last.ckpt", [])
    assert find_resume_checkpoint("auto", newest.parent, None) == (newest / "last.ckpt", [])


def copied_without_times(folder: Path, *names: str) -> None:
    """Give the checkpoints of ``folder`` the modification times of a copy that kept none (``cp -r``, ``rsync``
    without ``-t``): in the order named, the last one named the newest."""
    now = (folder / names[0]).stat().st_mtime
    for i, name in enumerate(names):
        for path in [folder / name, *(folder / name).glob("*")]:
            os.utime(path, (now + i, now + i))


@pytest.mark.parametrize("alias", ["last", "auto"])
def test_the_checkpoint_with_the_most_steps_is_resumed_whatever_its_file_time(alias, runs):
    """A run folder copied without its timestamps: last.ckpt (step 8) older than epoch_000.ckpt (step 4) is resumed,
    not the file that looks newer, which would lose training."""
    folder = runs / "2026-01-03_10-00-00" / "checkpoints"
    write(folder / "last.ckpt", good=True, step=8, epoch=1)
    write(folder / "epoch_000.ckpt", good=True, step=4, epoch=0)
    copied_without_times(folder, "last.ckpt", "epoch_000.ckpt")
    assert find_resume_checkpoint(alias, runs / "2026-01-04_10-00-00", runs) == (folder / "last.ckpt", [])
    assert find_resume_checkpoint(alias, folder.parent, None) == (folder / "last.ckpt", [])


def test_the_sharded_checkpoint_with_the_most_steps_is_resumed_whatever_its_file_time(runs):
    """Its metadata file holds its ``global_step``."""
    folder = runs / "2026-01-03_10-00-00" / "checkpoints"
    write_sharded(folder / "last.ckpt", step=8)
    write_sharded(folder / "epoch_000.ckpt", step=4)
    copied_without_times(folder, "last.ckpt", "epoch_000.ckpt")
    assert find_resume_checkpoint("last", runs / "2026-01-04_10-00-00", runs) == (folder / "last.ckpt", [])


def test_a_corrupt_checkpoint_is_skipped_for_the_one_with_the_most_steps_that_loads(runs):
    """The newest file does not load: the next in progress, not in file time, is resumed; the corrupt one is named."""
    folder = runs / "2026-01-03_10-00-00" / "checkpoints"
    write(folder / "epoch_001.ckpt", good=True, step=8, epoch=1)
    write(folder / "epoch_000.ckpt", good=True, step=4, epoch=0)
    write(folder / "last.ckpt", good=False)
    copied_without_times(folder, "epoch_001.ckpt", "epoch_000.ckpt", "last.ckpt")
    found, skipped = find_resume_checkpoint("last", runs / "2026-01-04_10-00-00", runs)
    assert (found, skipped) == (folder / "epoch_001.ckpt", [folder / "last.ckpt"])


@pytest.mark.parametrize("newer", ["last.ckpt", "epoch_001.ckpt"])
def test_between_checkpoints_of_equal_progress_the_newer_file_is_resumed(newer, runs):
    """Lightning writes the epoch's checkpoint and last.ckpt at the same step: either holds the same progress."""
    folder = runs / "2026-01-03_10-00-00" / "checkpoints"
    write(folder / "epoch_000.ckpt", good=True, step=4, epoch=0)
    write(folder / "epoch_001.ckpt", good=True, step=8, epoch=1)
    write(folder / "last.ckpt", good=True, step=8, epoch=1)
    older = next(name for name in ("last.ckpt", "epoch_001.ckpt") if name != newer)
    copied_without_times(folder, older, newer, "epoch_000.ckpt")
    assert find_resume_checkpoint("last", runs / "2026-01-04_10-00-00", runs) == (folder / newer, [])


def test_a_run_rewound_in_its_own_folder_goes_on_from_the_rewound_branch(runs):
    """A process started at 100 trained to step 12; a second one, started at 200, resumed its step-4 checkpoint in
    the same folder and got to step 8: the rewound branch's step 8 is resumed, not the abandoned branch's step 12
    (nor its epoch checkpoint of step 8, which is older in process), whatever the files' times say."""
    folder = runs / "2026-01-03_10-00-00" / "checkpoints"
    write(folder / "epoch_000.ckpt", good=True, step=4, epoch=0, started=100.0)
    write(folder / "epoch_001.ckpt", good=True, step=8, epoch=1, started=100.0)
    write(folder / "epoch_002.ckpt", good=True, step=12, epoch=2, started=100.0)
    write(folder / "last.ckpt", good=True, step=8, epoch=1, started=200.0)
    write(folder / "unstamped.ckpt", good=True, step=16, epoch=3)  # an earlier moekit's: before any stamped one
    copied_without_times(folder, "last.ckpt", "unstamped.ckpt", "epoch_000.ckpt", "epoch_001.ckpt", "epoch_002.ckpt")
    assert find_resume_checkpoint("last", runs / "2026-01-04_10-00-00", runs) == (folder / "last.ckpt", [])


def test_train_says_which_checkpoint_it_resumes(fake_fashion, tmp_path, caplog):
    """ckpt_path=last as scripts/train.py resolves it: last.ckpt (step 8), its file older than epoch_000.ckpt's."""
    logs = tmp_path / "logs"
    folder = logs / "train" / "runs" / "2026-01-01_10-00-00" / "checkpoints"
    write(folder / "last.ckpt", good=True, step=8, epoch=1)
    write(folder / "epoch_000.ckpt", good=True, step=4, epoch=0)
    copied_without_times(folder, "last.ckpt", "epoch_000.ckpt")
    job = logs / "train" / "runs" / "2026-01-02_10-00-00"
    cfg = compose_config("train", [*small_overrides(fake_fashion, 1), f"paths.log_dir={logs}", "ckpt_path=last"], job)
    with caplog.at_level("INFO", logger="moekit"):
        _resolve_resume_alias(cfg, job)
    assert cfg.ckpt_path == str(folder / "last.ckpt")
    assert f"ckpt_path=last: resuming from {folder / 'last.ckpt'}" in caplog.text


@pytest.mark.parametrize("damage", ["shard", "metadata", "no_metadata"])
def test_a_damaged_sharded_checkpoint_is_skipped_and_named(runs, damage):
    newest = runs / "2026-01-03_10-00-00" / "checkpoints"
    write_sharded(newest / "epoch_000.ckpt", age=5)
    write_sharded(newest / "last.ckpt", damage=damage)
    found, skipped = find_resume_checkpoint("last", runs / "2026-01-04_10-00-00", runs)
    assert (found, skipped) == (newest / "epoch_000.ckpt", [newest / "last.ckpt"])
    with pytest.raises(CheckpointError, match="could not be read.*beside it: epoch_000.ckpt"):
        read_training_checkpoint(newest / "last.ckpt")


def test_an_unreadable_checkpoint_error_quotes_a_whole_sentence(tmp_path):
    """torch's message goes on with advice of its own ("there is a high likelihood that your checkpoint file is
    corrupted ..."): the error quotes its first sentence, whole, not the first 200 characters."""
    path = tmp_path / "half.ckpt"
    torch.save({"state_dict": {"w": torch.ones(256)}, "optimizer_states": [], "epoch": 0}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as err:
        read_training_checkpoint(path)
    cause = "(RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory). It is"
    assert cause in str(err.value) and "likelihood" not in str(err.value)


@pytest.mark.parametrize(
    "content,cause",
    [
        (b"", "EOFError: Ran out of input"),  # a copy that never got its bytes
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n", "UnpicklingError"),  # a Git LFS pointer
    ],
    ids=["empty", "lfs-pointer"],
)
def test_a_file_that_is_no_checkpoint_is_named_by_its_own_error(content, cause, tmp_path):
    """Not torch's mmap advice to save the file again with _use_new_zipfile_serialization=True."""
    path = tmp_path / "last.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        read_training_checkpoint(path)
    assert f"could not be read ({cause}" in str(err.value) and "mmap" not in str(err.value)
    assert "corrupt, truncated or not a PyTorch checkpoint" in str(err.value)


def test_a_checkpoint_in_torchs_legacy_format_is_read(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    saved = {"state_dict": {"net.w": torch.arange(4.0)}, "optimizer_states": [], "epoch": 3}
    torch.save(saved, path, _use_new_zipfile_serialization=False)
    checkpoint = read_training_checkpoint(path)
    assert checkpoint["epoch"] == 3 and torch.equal(checkpoint["state_dict"]["net.w"], saved["state_dict"]["net.w"])
    assert find_resume_checkpoint("last", tmp_path, None) == (path, [])


def test_a_folder_given_as_ckpt_path_is_called_a_folder_and_its_checkpoints_named(runs):
    folder = runs / "2026-01-02_10-00-00" / "checkpoints"
    expected = "is a folder, not a checkpoint .* the checkpoints in it: last.ckpt, epoch_001.ckpt, epoch_000.ckpt"
    with pytest.raises(CheckpointError, match=expected) as err:
        check_ckpt_path(str(folder), sharded_ok=True)
    assert "does not exist" not in str(err.value) and "give the path of a .ckpt file" in str(err.value)
    with pytest.raises(CheckpointError, match="is a folder, not a checkpoint \\(a sharded one would hold meta.pt\\);"):
        check_ckpt_path(str(runs / "2026-01-03_10-00-00"))


def _module(experiment: str, tmp_path: Path, *extra: str):
    """The task ``experiment=<experiment> debug=tiny`` builds, as scripts/train.py builds it."""
    cfg = compose_config("train", [f"experiment={experiment}", "debug=tiny", *extra], tmp_path / experiment)
    run_config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    return instantiate(cfg.task, net=cfg.model, run_config=run_config, _recursive_=False)


@pytest.mark.parametrize(
    "saved,resumed,expected",
    [
        (
            "moe_transformer_lm",
            "soft_moe_vit",
            "a LanguageModel of a TransformerLM .task_name moe_transformer_lm., but this run builds an "
            "ImageClassifier of a VisionTransformer: resume it with experiment=moe_transformer_lm",
        ),
        (
            "soft_moe_vit",
            "moe_transformer_lm",
            "an ImageClassifier of a vit_tiny_patch4_28 .task_name soft_moe_vit., but this run builds a "
            "LanguageModel of a TransformerLM: resume it with experiment=soft_moe_vit",
        ),
    ],
)
def test_a_checkpoint_of_another_task_is_refused_naming_both(saved, resumed, expected, tmp_path):
    """Not a list of every model setting as an override (with task.init_from, which fails on it too)."""
    writer = _module(saved, tmp_path)
    checkpoint = {
        "state_dict": {},
        "optimizer_states": [],
        "epoch": 0,
        "hyper_parameters": {"run_config": writer.hparams["run_config"]},
        TASK_KEY: f"{type(writer).__module__}:{type(writer).__qualname__}",
    }
    path = write(tmp_path / "last.ckpt", good=True)
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match=expected) as err:
        check_resume_checkpoint(str(path), _module(resumed, tmp_path))
    assert "task.init_from" not in str(err.value) and "model._target_" not in str(err.value)


def test_a_sharded_checkpoint_is_refused_by_a_run_without_fsdp(tmp_path):
    """trainer.fit would fail on the folder with IsADirectoryError; a trainer=fsdp run reads it."""
    folder = write_sharded(tmp_path / "old" / "checkpoints" / "last.ckpt")
    with pytest.raises(
        CheckpointError, match="is a sharded checkpoint .*strategy: 'auto'.*resume it with trainer=fsdp"
    ):
        check_resume_checkpoint(str(folder), _module("soft_moe_vit", tmp_path))
    check_resume_checkpoint(str(folder), _module("soft_moe_vit", tmp_path, "trainer=fsdp"))


def test_a_folder_of_corrupt_checkpoints_is_named(tmp_path):
    runs = tmp_path / "runs"
    write(runs / "a" / "checkpoints" / "last.ckpt", good=False)
    with pytest.raises(CheckpointError, match="none of the checkpoints of .* loads \\(last.ckpt: corrupt"):
        find_resume_checkpoint("last", runs / "b", runs)


def test_a_corrupt_checkpoint_error_names_the_checkpoints_beside_it(runs):
    folder = runs / "2026-01-02_10-00-00" / "checkpoints"
    beside = "could not be read.*ckpt_path=last.*beside it: epoch_001.ckpt, epoch_000.ckpt"
    with pytest.raises(CheckpointError, match=beside):
        read_training_checkpoint(folder / "last.ckpt")
    with pytest.raises(CheckpointError, match="or ckpt_path=last for the newest checkpoint"):
        check_ckpt_path(str(folder / "missing.ckpt"))


@pytest.mark.e2e
def test_train_resumes_with_ckpt_path_last(fake_fashion, tmp_path):
    logs = tmp_path / "logs"
    first = logs / "train" / "runs" / "2026-01-01_10-00-00"
    train(compose_config("train", [*small_overrides(fake_fashion, 1), f"paths.log_dir={logs}", "test=false"], first))
    saved = torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    second = logs / "train" / "runs" / "2026-01-01_11-00-00"
    overrides = [*small_overrides(fake_fashion, 2), f"paths.log_dir={logs}", "test=false", "ckpt_path=last"]
    cfg = compose_config("train", overrides, second)
    train(cfg)
    assert cfg.ckpt_path == str(first / "checkpoints" / "last.ckpt"), "the run record names the checkpoint"
    resumed = torch.load(second / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert resumed["global_step"] == 2 * saved["global_step"], "one more epoch on top of the saved one"
    assert resumed[FIT_STARTED_KEY] > saved[FIT_STARTED_KEY], "each process stamps its checkpoints with its start"
    logged = {int(float(row["epoch"])) for row in metrics_rows(second) if "epoch" in row}
    assert logged == {1}, "the resumed run trains epoch 1 only: a fresh run would log epoch 0 too"
