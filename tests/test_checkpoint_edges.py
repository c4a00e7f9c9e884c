"""Edge cases of checkpoint writing and resuming: the sampler's shares when the dataset is smaller than the world,
CUDA random states saved on more devices than the resuming process sees, and write delays that are no finite
number of seconds."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.checkpoint import WRITE_DELAY_ENV, atomic_torch_save
from moekit.data.resumable import ResumableRandomSampler, set_rng_states


@pytest.mark.parametrize(("size", "world"), [(1, 4), (2, 5), (3, 8), (5, 16)])
def test_every_rank_gets_its_share_of_a_dataset_smaller_than_the_world(size, world):
    """As DistributedSampler: the order is repeated until every rank has ``len(sampler)`` indices (ranks that got
    fewer would run fewer batches than the others, and data-parallel training waits on them for ever)."""
    samplers = [ResumableRandomSampler(size, 2, seed=0, num_replicas=world, rank=rank) for rank in range(world)]
    shares = [list(sampler) for sampler in samplers]
    assert [len(share) for share in shares] == [len(sampler) for sampler in samplers]
    assert [len(share) for share in shares] == [math.ceil(size / world)] * world
    assert {index for share in shares for index in share} == set(range(size))
    padded = samplers[0].epoch_order(0).repeat(world)[: samplers[0].total_size].tolist()
    assert [index for position in zip(*shares) for index in position] == padded


def test_padding_a_dataset_larger_than_the_world_repeats_its_start():
    """The order checkpoints were written with: the padding is the epoch order's first indices."""
    size, world = 10, 4
    order = ResumableRandomSampler(size, 3, seed=5).epoch_order(0)
    padded = torch.cat([order, order[: 12 - size]])
    for rank in range(world):
        assert ResumableRandomSampler(size, 3, 5, world, rank).rank_order(0) == padded[rank::world].tolist()


def test_cuda_states_of_more_devices_than_this_process_sees_restore_the_ones_it_sees(monkeypatch):
    """A run saved on a machine with two GPUs visible resumes where one is (another node, ``CUDA_VISIBLE_DEVICES``):
    the states of the devices that exist are put back; asking for device 1 would fail (invalid device ordinal)."""
    restored = {}

    def set_rng_state(state, device=0):
        if device >= 1:
            raise RuntimeError("CUDA error: invalid device ordinal")
        restored[device] = state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)
    states = [torch.full((16,), device, dtype=torch.uint8) for device in range(2)]
    set_rng_states({"cuda": states})
    assert list(restored) == [0] and torch.equal(restored[0], states[0])


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_write_delay_of_no_finite_seconds_is_refused_before_the_write(value, tmp_path, monkeypatch):
    """Named as a bad setting, not failing inside ``time.sleep`` once the temporary file is written."""
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)
    monkeypatch.setenv(WRITE_DELAY_ENV, value)
    with pytest.raises(ValueError, match=f"{WRITE_DELAY_ENV}='{value}' must be a finite number of seconds"):
        atomic_torch_save({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
