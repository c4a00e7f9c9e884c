"""A mid-epoch resume draws the first resumed batch's augmentations from python's ``random`` and numpy's global
generator as the uninterrupted run did, not only from torch's (timm's transforms draw from ``random``).

No training: a ``DataLoader(num_workers=0)`` over a dataset whose items are draws of the three generators, iterated as
Lightning does (one batch fetched ahead of the step), a "model" drawing from them at each step, and the sampler's state
taken where Lightning's checkpoint takes it, after a step. A new "process" (every generator seeded otherwise, a new
sampler and loader) loads that state and must see the same batches and model draws as the run that went on.
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

from distributed import spawn
from moekit.data import ImageClassificationDataModule
from moekit.data.resumable import ResumableRandomSampler

SIZE, BATCH, SEED, STOP = 20, 4, 3, 2  # 5 batches an epoch; the checkpoint after 2 steps


class _Draws(Dataset):
    """Item ``i``: ``i`` and one draw of each global generator, as an augmentation would make."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int):
        return index, random.random(), np.random.rand(), torch.rand(())


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _loader(sampler: ResumableRandomSampler) -> DataLoader:
    return DataLoader(_Draws(), batch_size=BATCH, sampler=sampler, num_workers=0)


def _epoch(loader: DataLoader, after_step=None) -> list[tuple[list, tuple[float, float, float]]]:
    """One epoch as Lightning's fit loop runs it: the next batch is fetched before the step on the current one;
    each step's "model" draws from the three generators; ``after_step(steps done)`` where a checkpoint would be."""
    steps, iterator = [], iter(loader)
    current = next(iterator, None)
    while current is not None:
        upcoming = next(iterator, None)  # Lightning fetches one batch ahead
        model = (torch.rand(()).item(), random.random(), float(np.random.rand()))
        steps.append(([column.tolist() for column in current], model))
        if after_step is not None:
            after_step(len(steps))
        current = upcoming
    return steps


def _uninterrupted() -> tuple[list, list, dict]:
    """Two epochs, and the sampler's state after step ``STOP`` of the first (saved and loaded as a checkpoint is)."""
    _seed_all(0)
    sampler, saved = ResumableRandomSampler(SIZE, BATCH, SEED), {}

    def checkpoint(steps: int) -> None:
        if steps == STOP:
            saved["state"] = sampler.state_dict(consumed_batches=steps, epoch_done=False)

    loader = _loader(sampler)
    first = _epoch(loader, checkpoint)
    second = _epoch(loader)
    buffer = io.BytesIO()
    torch.save(saved["state"], buffer)
    buffer.seek(0)
    return first, second, torch.load(buffer, weights_only=True)


def _resumed(state: dict) -> tuple[list, list]:
    _seed_all(12345)  # whatever the new process did before
    sampler = ResumableRandomSampler(SIZE, BATCH, SEED)
    sampler.load_state_dict(state)
    loader = _loader(sampler)
    return _epoch(loader), _epoch(loader)


def test_the_first_resumed_batch_draws_from_python_numpy_and_torch_as_it_did():
    first, second, state = _uninterrupted()
    resumed_first, resumed_second = _resumed(state)
    assert len(resumed_first) == len(first) - STOP
    columns = ("index", "python", "numpy", "torch")
    for step, (got, expected) in enumerate(zip(resumed_first, first[STOP:]), start=STOP):
        for name, got_column, expected_column in zip(columns, got[0], expected[0]):
            assert got_column == expected_column, f"batch {step}: the {name} draws differ after the resume"
        assert got[1] == expected[1], f"step {step}: the model's draws differ after the resume"
    assert resumed_second == second, "the next epoch as without the interruption"


def test_a_checkpoint_with_only_the_torch_state_per_batch_still_resumes():
    """Written before the python and numpy states were kept per batch: ``batch_rng`` is the bare torch state. Its
    torch draws replay; from the second batch on, every draw is the uninterrupted run's."""
    first, second, state = _uninterrupted()
    state["ranks"][0]["batch_rng"] = state["ranks"][0]["batch_rng"]["torch"]
    resumed_first, resumed_second = _resumed(state)
    (index, _, _, torch_draws), _ = resumed_first[0]
    assert index == first[STOP][0][0] and torch_draws == first[STOP][0][3]
    assert resumed_first[1:] == first[STOP + 1 :] and resumed_second == second


def _rank_resumes(rank: int, world: int, results) -> None:
    _seed_all(100 + rank)  # each rank's generators differ
    sampler, saved = ResumableRandomSampler(SIZE, BATCH, SEED, world, rank), {}

    def checkpoint(steps: int) -> None:
        if steps == 1:  # a collective: every rank's states are gathered
            saved["state"] = sampler.state_dict(consumed_batches=steps, epoch_done=False)

    first = _epoch(_loader(sampler), checkpoint)
    assert len(saved["state"]["ranks"]) == world
    _seed_all(999)
    resumed = ResumableRandomSampler(SIZE, BATCH, SEED, world, rank)
    resumed.load_state_dict(saved["state"])
    results[rank] = _epoch(_loader(resumed)) == first[1:]


def test_each_rank_resumes_with_its_own_batch_states():
    results = mp.get_context("fork").Manager().dict()
    spawn(_rank_resumes, 2, results)
    assert dict(results) == {0: True, 1: True}


def test_a_checkpoint_of_the_single_process_layout_still_resumes():
    """The oldest layout: no ``ranks``, the states (the per-batch one a bare torch state) at the top level."""
    first, second, state = _uninterrupted()
    own = state.pop("ranks")[0]
    del state["num_replicas"]
    resumed_first, resumed_second = _resumed({**state, "rng": own["rng"], "batch_rng": own["batch_rng"]["torch"]})
    assert resumed_first[0][0][3] == first[STOP][0][3], "its torch draws replay"
    assert resumed_first[1:] == first[STOP + 1 :] and resumed_second == second


@pytest.mark.e2e
def test_an_imagefolder_run_resumed_mid_epoch_ends_with_the_uninterrupted_runs_weights(tmp_path):
    """timm's training transforms (random resized crop, RandAugment) draw from python's and numpy's generators in the
    training process (``num_workers=0``): a run stopped by ``max_steps`` inside its first epoch and resumed ends with
    the weights and optimizer state of the run that never stopped. (Lightning fetches this sized loader's batches as
    the steps need them, so no batch was drawn before the checkpoint: the resume restores the states of the
    checkpoint, not a batch's; the tests above cover a loader fetched one batch ahead.)"""
    from test_image_data_flows import _write_folder

    from conftest import compose_config
    from moekit.commands.train import train
    from resume_helpers import assert_same_training_state, load_checkpoint

    root = _write_folder(tmp_path / "images")  # 12 training images: 3 batches of 4 an epoch
    common = [
        "experiment=soft_moe_vit",
        "data=imagefolder",
        f"data.root={root}",
        "data.num_classes=3",
        "data.img_size=28",
        "data.num_workers=0",
        "data.batch_size=4",
        "data.pin_memory=false",
        "debug=tiny",
        "trainer.max_epochs=2",
        "trainer.precision=32-true",
        "trainer.deterministic=true",
        "task.scheduler.name=constant",
        "task.scheduler.warmup_steps=0",
        "logger=csv",
        "test=false",
    ]
    train(compose_config("train", common, tmp_path / "reference"))
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    train(compose_config("train", [*common, "trainer.max_steps=1"], run))
    assert load_checkpoint(last)["global_step"] == 1
    train(compose_config("train", [*common, f"ckpt_path={last}"], run))
    reference = load_checkpoint(tmp_path / "reference" / "checkpoints" / "last.ckpt")
    assert_same_training_state(load_checkpoint(last), reference, global_step=6)


def _batches(loader: DataLoader, count: int | None = None) -> list[torch.Tensor]:
    out = []
    for images, _ in loader:
        out.append(images.clone())
        if count is not None and len(out) == count:
            break
    return out


def _worker_datamodule(root, num_workers: int) -> ImageClassificationDataModule:
    module = ImageClassificationDataModule(
        root=str(root), batch_size=64, num_workers=num_workers, val_size=64, seed=SEED, augment="basic"
    )
    module.setup()
    return module


@pytest.mark.parametrize("resume_workers", [2, 1])
def test_worker_processes_draw_each_batch_as_the_uninterrupted_run_did(fake_fashion, resume_workers):
    """With worker processes, each training batch's augmentation (random crop and flip, drawn in the worker) is a
    function of the batch: a run resumed mid-epoch, with the same or another number of workers, gets the batches the
    uninterrupted run got, and different batches get different draws."""
    reference = _worker_datamodule(fake_fashion, num_workers=2)
    loader = reference.train_dataloader()
    uninterrupted = _batches(loader)
    state = reference._train_sampler.state_dict(STOP, epoch_done=False)  # the checkpoint after STOP steps
    next_epoch = _batches(loader)
    assert not torch.equal(uninterrupted[0], uninterrupted[1])
    _seed_all(SEED + 1)  # a new process
    resumed = _worker_datamodule(fake_fashion, num_workers=resume_workers)
    resumed.load_state_dict({"train_sampler": state})
    loader = resumed.train_dataloader()
    after = _batches(loader)
    assert len(after) == len(uninterrupted) - STOP
    for got, want in zip(after, uninterrupted[STOP:], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(_batches(loader), next_epoch, strict=True):
        assert torch.equal(got, want)
