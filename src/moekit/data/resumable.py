"""A training sampler whose position can be saved in a checkpoint, so a resumed run sees the same batches.

Lightning restores the loops' counters when it resumes from a checkpoint, but a plain shuffled
``DataLoader`` starts its epoch again from the first batch (in a fresh order), and the random
number generators continue from wherever the new process left them. :class:`ResumableRandomSampler`
makes the data side exact:

- the order of epoch ``e`` is a pure function of ``(seed, e)``, not of how many epochs this process
  has iterated;
- :meth:`ResumableRandomSampler.state_dict` records the epoch, how many batches of it the model has
  consumed and the random states (torch, CUDA, numpy, python), plus the torch, numpy and python states
  with which the next batch was drawn if it was fetched before the checkpoint was written (Lightning's
  fetcher fetches one batch ahead for a loader without a length; a loader with one, as the datamodules'
  are, is fetched as the steps need it, and the states at the checkpoint are the next batch's). Such a
  batch has already been augmented with the global generators (torch's, and python's ``random`` and
  numpy's, which timm's transforms draw from); the sampler keeps the states it saw at the start of each
  batch to replay that draw;
- after :meth:`ResumableRandomSampler.load_state_dict`, the next iteration starts at the saved epoch
  and batch, puts the saved states back for the first batch's augmentation, then restores the
  process-wide states the model saw when the checkpoint was written. (A checkpoint written before the
  numpy and python states were kept per batch replays that batch's torch draws only.)

The datamodules save this state through ``LightningDataModule.state_dict`` (Lightning stores it in
every checkpoint) using the trainer's count of processed batches.

Worker processes (``num_workers > 0``) draw from generators of their own, seeded once per worker, whose states a
checkpoint cannot hold (nor say which worker drew which batch). There the sampler gives each batch a seed of its
own, a function of ``(seed, epoch, rank, batch)``, and :class:`SeededBatches` seeds the worker's torch, numpy and
python generators with it before the batch is fetched: a batch's augmentation is the same whichever worker
draws it, with any number of workers (above 0), before a resume and after.

Data parallel training (DDP, FSDP). The sampler shards itself like ``DistributedSampler``: every rank
draws the same epoch order, pads it to a multiple of the world size by repeating it from its start, and takes
every ``num_replicas``-th index from position ``rank``. It is a ``DistributedSampler`` subclass, so
Lightning leaves it unwrapped. A checkpoint holds the random states of every rank (gathered when it is
written) and each rank resumes with its own. A checkpoint written in the middle of an epoch resumes at
the same position only with the same world size, dataset size and batch size, and is refused with others (its
position does not exist there); at an epoch boundary any of them continues exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

__all__ = ["ResumableRandomSampler", "SeededBatches", "get_rng_states", "set_rng_states"]


def _numpy_state(state: tuple | None = None) -> dict[str, Any]:
    """numpy's global state (``state``: one of ``np.random.get_state()``) as a tensor, ints and a float."""
    kind, keys, pos, has_gauss, cached = np.random.get_state() if state is None else state
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def get_rng_states() -> dict[str, Any]:
    """The process's random states (torch CPU, every initialised CUDA device, numpy, python) as tensors,
    ints and tuples only, so a checkpoint holding them loads with ``torch.load(..., weights_only=True)``."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back the states of :func:`get_rng_states` (those of its keys that ``states`` has)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "numpy" in states:
        numpy_state = states["numpy"]
        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():  # the devices this process sees (maybe fewer than saved)
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


class ResumableRandomSampler(DistributedSampler):
    """Shuffled indices of ``range(dataset_size)``, a new seeded order each epoch, resumable mid-epoch,
    this rank's share of them under data parallelism.

    Args:
        dataset_size: size of the dataset.
        batch_size: the loader's batch size (positions are saved in batches of this rank).
        seed: seeds the orders: epoch ``e`` uses ``numpy.random.SeedSequence([seed, e])``.
        num_replicas, rank: data-parallel ranks and this one's index (1, 0: everything).
        seed_batches: yield ``(index, batch seed)`` pairs (:meth:`batch_seed`) for a dataset wrapped in
            :class:`SeededBatches`, as worker processes need.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed_batches: bool = False,
    ):
        if dataset_size <= 0:
            raise ValueError(f"ResumableRandomSampler: dataset_size={dataset_size} must be > 0 (an empty dataset)")
        if batch_size <= 0:
            raise ValueError(f"ResumableRandomSampler: batch_size={batch_size} must be > 0")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableRandomSampler: rank={rank} must be in [0, num_replicas={num_replicas})")
        # DistributedSampler's attributes, for code that reads them (its __init__ would need a dataset).
        self.num_replicas, self.rank, self.shuffle, self.drop_last, self.epoch = num_replicas, rank, True, False, 0
        self.dataset_size = dataset_size
        self.num_samples = math.ceil(dataset_size / num_replicas)  # this rank's share
        self.total_size = self.num_samples * num_replicas
        self.batch_size = batch_size
        self.seed = int(seed)
        self.seed_batches = seed_batches
        self._next_epoch = 0  # the epoch the next __iter__ yields
        self._epoch: int | None = None  # the epoch being iterated
        # batch position -> the torch, python and numpy states before it was drawn (as their getters return them)
        self._batch_states: dict[int, tuple[torch.Tensor, tuple, tuple]] = {}
        self._resume: dict[str, Any] | None = None  # loaded, applied by the next __iter__

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_batches(self) -> int:
        """Batches per epoch, counting a last partial one."""
        return math.ceil(self.num_samples / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this each epoch; the sampler counts epochs itself (resumes included)."""
        self.epoch = epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of epoch ``epoch`` over all ranks: ``[dataset_size]`` int64."""
        seed = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1, dtype=np.uint64)[0] >> 1)
        return torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(seed))

    def rank_order(self, epoch: int) -> list[int]:
        """This rank's indices of epoch ``epoch``: ``num_samples`` of them."""
        order = self.epoch_order(epoch)
        if self.total_size > self.dataset_size:  # pad by repeating the order, as DistributedSampler does
            order = order.repeat(math.ceil(self.total_size / self.dataset_size))[: self.total_size]
        return order[self.rank :: self.num_replicas].tolist()

    def batch_seed(self, epoch: int, batch: int) -> int:
        """The seed of this rank's batch ``batch`` of epoch ``epoch`` (``seed_batches``): a 63-bit int."""
        entropy = [self.seed, epoch, self.rank, batch]
        return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        resume, self._resume = self._resume, None
        start = resume["batch"] if resume is not None else 0
        self._epoch, self._batch_states = epoch, {}
        order = self.rank_order(epoch)
        for batch in range(start, self.num_batches):
            if resume is not None:
                self._replay(resume, batch - start)
            self._batch_states = {b: s for b, s in self._batch_states.items() if b >= batch - 4}
            self._batch_states[batch] = (torch.get_rng_state(), random.getstate(), np.random.get_state())
            indices = order[batch * self.batch_size : (batch + 1) * self.batch_size]
            if self.seed_batches:
                batch_seed = self.batch_seed(epoch, batch)
                yield from ((index, batch_seed) for index in indices)
            else:
                yield from indices
        if resume is not None:
            self._replay(resume, self.num_batches - start)

    @staticmethod
    def _replay(resume: dict[str, Any], batches_since_resume: int) -> None:
        """First resumed batch: draw it with the states it was drawn with; then give the model back the
        states it had when the checkpoint was written."""
        if batches_since_resume == 0:
            set_rng_states(resume["rng"])
            if resume["batch_rng"] is not None:
                set_rng_states(resume["batch_rng"])
        elif batches_since_resume == 1 and resume["batch_rng"] is not None:
            set_rng_states(resume["rng"])

    def state_dict(self, consumed_batches: int, epoch_done: bool) -> dict[str, Any]:
        """Where to continue after ``consumed_batches`` batches of the current epoch have been trained on
        (``epoch_done``: the epoch is over, continue with the next one). Under ``torch.distributed`` with
        several ranks this is a collective (the random states of every rank are gathered)."""
        if self._epoch is None or epoch_done:
            epoch = self._next_epoch if self._epoch is None else self._epoch + 1
            state = {"epoch": epoch, "batch": 0, "batch_rng": None}
        else:
            state = {"epoch": self._epoch, "batch": consumed_batches, "batch_rng": None}
            if consumed_batches in self._batch_states:
                torch_state, python_state, numpy_state = self._batch_states[consumed_batches]
                state["batch_rng"] = {"torch": torch_state, "numpy": _numpy_state(numpy_state), "python": python_state}
        own = {"rng": get_rng_states(), "batch_rng": state.pop("batch_rng")}
        ranks = [own]
        if self.num_replicas > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * self.num_replicas
            dist.all_gather_object(ranks, own)
        sizes = {"dataset_size": self.dataset_size, "batch_size": self.batch_size}
        return {**state, **sizes, "num_replicas": self.num_replicas, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (of :meth:`state_dict`) at the next iteration."""
        if "ranks" not in state:  # written by a single process before checkpoints held every rank
            state = {**state, "num_replicas": 1, "ranks": [{"rng": state["rng"], "batch_rng": state["batch_rng"]}]}
        saved_world = state["num_replicas"]
        now = {"num_replicas": self.num_replicas, "dataset_size": self.dataset_size, "batch_size": self.batch_size}
        changed = [f"{key} {state[key]} (now {value})" for key, value in now.items() if state.get(key, value) != value]
        if state["batch"] and changed:  # the ranks, the windows or the batch size changed since
            raise ValueError(
                f"the checkpoint was written after batch {state['batch']} of epoch {state['epoch']} with other data "
                f"settings: {', '.join(changed)}; that position does not exist with these settings, and going on from "
                "it would skip or repeat samples. Resume with the checkpoint's settings (data.batch_size, "
                "trainer.devices x trainer.num_nodes, and the data settings that size the training set), or from a "
                "checkpoint written at an epoch's end, which continues with the next epoch under any of them"
            )
        if not 0 <= state["batch"] <= self.num_batches:
            raise ValueError(
                f"ResumableRandomSampler: the checkpoint resumes at batch {state['batch']} of an epoch of "
                f"{self.num_batches} batches; resume with the same dataset and batch size"
            )
        own = state["ranks"][self.rank] if saved_world == self.num_replicas else state["ranks"][0]
        batch_rng = own["batch_rng"] if saved_world == self.num_replicas else None
        if isinstance(batch_rng, torch.Tensor):  # written when only the torch state was kept per batch
            batch_rng = {"torch": batch_rng}
        self._next_epoch = int(state["epoch"])
        self._resume = {"batch": state["batch"], "rng": own["rng"], "batch_rng": batch_rng}


class SeededBatches(Dataset):
    """``dataset`` fetched by ``(index, batch seed)`` keys (a :class:`ResumableRandomSampler` with
    ``seed_batches=True``), for a loader with worker processes: before fetching a batch the worker's torch, numpy
    and python generators are seeded with the batch's seed, so its random augmentation is a function of the batch
    alone. Only for worker processes: in the main process it would reseed the generators the model draws from."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    @staticmethod
    def _seed(seed: int) -> None:
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        """One batch (the loader asks for a batch's keys at once): seeded with its seed, fetched in order."""
        self._seed(keys[0][1])
        indices = [index for index, _ in keys]
        fetch_many = getattr(self.dataset, "__getitems__", None)
        return fetch_many(indices) if fetch_many else [self.dataset[index] for index in indices]

    def __getitem__(self, key: tuple[int, int]):
        index, seed = key
        self._seed((seed + index) % 2**63)  # one item alone: its own seed
        return self.dataset[index]


class ResumableTrainOrderMixin:
    """For a ``LightningDataModule``: saves and restores its :class:`ResumableRandomSampler` through the
    datamodule's ``state_dict`` / ``load_state_dict`` (which Lightning writes into every checkpoint).

    The datamodule builds its training loader with :meth:`_train_sampler_for`; a loader built again (Lightning's
    ``reload_dataloaders_every_n_epochs``) continues with the epoch after the last one the previous loader began.
    """

    _train_sampler: ResumableRandomSampler | None = None
    _pending_sampler_state: dict[str, Any] | None = None

    def _train_sampler_for(
        self, num_samples: int, batch_size: int, seed: int, seed_batches: bool = False
    ) -> ResumableRandomSampler:
        trainer = getattr(self, "trainer", None)
        ranks = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
        sampler = ResumableRandomSampler(
            num_samples, batch_size, seed, ranks.get("num_replicas", 1), ranks.get("rank", 0), seed_batches
        )
        previous = self._train_sampler
        if previous is not None and previous.dataset_size == num_samples:  # a loader built again: where it was
            sampler._next_epoch, sampler._resume = previous._next_epoch, previous._resume
        if self._pending_sampler_state is not None:
            sampler.load_state_dict(self._pending_sampler_state)
            self._pending_sampler_state = None
        self._train_sampler = sampler
        return sampler

    def state_dict(self) -> dict[str, Any]:
        sampler = self._train_sampler
        trainer = getattr(self, "trainer", None)
        if sampler is None or trainer is None:
            return {}
        consumed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"train_sampler": sampler.state_dict(consumed, epoch_done=consumed >= trainer.num_training_batches)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_sampler")
        if state is None:
            return
        if self._train_sampler is not None:
            self._train_sampler.load_state_dict(state)
        else:
            self._pending_sampler_state = state
