"""Training-epoch means under data parallelism, on 2 gloo CPU processes through Lightning's DDP: the logged
``train/*_epoch`` mean is the weighted mean over the batches of all ranks when the ranks' weights differ (padded
batches weighed by their real tokens, as a language model's), and a checkpoint written in the middle of the epoch
holds the sums of all ranks, from which a resumed run logs the uninterrupted run's mean."""

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from distributed import spawn
from moekit.callbacks.step_checkpoint import StepCheckpoint
from moekit.tasks.base import EPOCH_MEANS_KEY, MoETask
from moekit.tasks.epoch_means import EpochMeans

pytestmark = pytest.mark.e2e  # starts processes (make test-fast leaves it out)

NAME = "train/value_epoch"
BATCHES, TOKENS = 4, 4


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0's batches are all real tokens (4 each); rank 1's are mostly padding (1 or 2 real tokens each)."""
    batches = []
    for b in range(BATCHES):
        values = torch.arange(TOKENS, dtype=torch.float32) + 10 * rank + b
        real = TOKENS if rank == 0 else 1 + b % 2
        batches.append((values, torch.arange(TOKENS) < real))
    return batches


def _sums(batches) -> tuple[float, int]:
    """(sum of the real tokens' values, number of real tokens), by hand."""
    total = sum(float(values[mask].sum()) for values, mask in batches)
    return total, sum(int(mask.sum()) for _, mask in batches)


class _Task(MoETask):
    """Logs each batch's mean value over its real tokens, weighted by their count (a tensor on the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.setup_training({"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1}, None, None)

    def training_step(self, batch, batch_idx):
        values, mask = batch
        real = mask.sum()
        self.log_epoch_mean(NAME, (values * mask).sum() / real, real)
        return self.net(values[:, None]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(rank: int, world: int, batches, ckpt_path: str | None = None, **options) -> float:
    """One epoch (or ``max_steps``) over ``batches`` on this rank; the logged epoch mean."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # each rank trains the batches given to it
        **options,
    )
    trainer.fit(_Task(), DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return float(trainer.callback_metrics[NAME]) if NAME in trainer.callback_metrics else float("nan")


def _unequal_weights(rank: int, world: int) -> None:
    (total_0, count_0), (total_1, count_1) = _sums(_batches(0)), _sums(_batches(1))
    expected = (total_0 + total_1) / (count_0 + count_1)  # 120 / 22
    mean_of_ranks = (total_0 / count_0 + total_1 / count_1) / 2
    assert abs(expected - mean_of_ranks) > 1, "the ranks' weights differ enough to tell the two apart"
    logged = _fit(rank, world, _batches(rank), enable_checkpointing=False)
    assert logged == pytest.approx(expected, rel=1e-6), (logged, expected, mean_of_ranks)


def test_epoch_mean_weighs_every_rank_by_its_tokens():
    spawn(_unequal_weights, 2)


def _resume_mid_epoch(rank: int, world: int, folder: str) -> None:
    uninterrupted = _fit(rank, world, _batches(rank), enable_checkpointing=False)

    checkpoints = Path(folder)
    saver = StepCheckpoint(str(checkpoints), every_n_train_steps=2)
    _fit(rank, world, _batches(rank), max_steps=2, callbacks=[saver])  # written after batch 2 of 4
    saved = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)[EPOCH_MEANS_KEY]
    total, count = saved["sums"][NAME]
    (total_0, count_0), (total_1, count_1) = _sums(_batches(0)[:2]), _sums(_batches(1)[:2])
    assert (float(total), int(count)) == (pytest.approx(total_0 + total_1), count_0 + count_1), "both ranks' sums"

    # Lightning goes on with the next batch of a fresh iterator (moekit's resumable sampler skips the batches
    # trained before the checkpoint): the resumed run's loader starts at batch 3.
    rest = _batches(rank)[2:] + _batches(rank)[:2]
    resumed = _fit(rank, world, rest, ckpt_path=str(checkpoints / "last.ckpt"), enable_checkpointing=False)
    assert resumed == pytest.approx(uninterrupted, rel=1e-6), (resumed, uninterrupted)


def test_mid_epoch_resume_on_2_ranks_logs_the_uninterrupted_epoch_mean(tmp_path):
    spawn(_resume_mid_epoch, 2, str(tmp_path))


def test_saved_sums_are_taken_by_one_rank():
    """A checkpoint's sums (here an older file's: a plain int count) are restored by rank 0; the other ranks
    restore the same names at zero, so that the sum over ranks counts them once."""
    state = {"epoch": 3, "sums": {NAME: (torch.tensor(12.0), 4)}}
    first, other = EpochMeans(), EpochMeans()
    first.load_state_dict(state)
    other.load_state_dict(state, keep=False)
    assert first.compute()[NAME] == 3.0 and first.epoch == other.epoch == 3
    total, count = other.sums[NAME]
    assert float(total) == 0.0 and count == 0
    both = first.reduced(lambda sums: sums * 2, torch.device("cpu"))  # an all-reduce over 2 ranks holding these
    total, count = both.sums[NAME]
    assert (float(total), int(count), both.epoch) == (24.0, 8, 3) and float(both.compute()[NAME]) == 3.0
