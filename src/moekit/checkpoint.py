"""Checkpoints: written atomically, read with errors that say what is wrong and what to do.

* Writing (:class:`AtomicCheckpointIO`, the trainer's ``CheckpointIO`` in ``configs/trainer/default.yaml``):
  every file Lightning writes (``last.ckpt``, ``epoch_XXX.ckpt``, ``trainer.save_checkpoint``) is serialised
  into a temporary file in its folder, flushed and ``fsync``-ed, renamed onto the final name with
  ``os.replace`` (atomic on POSIX within one file system), and the folder is ``fsync``-ed so the rename itself
  survives a power cut: a crash or a kill mid-write never damages the last good checkpoint. Lightning's own
  ``TorchCheckpointIO`` writes through an fsspec transaction but never ``fsync``-s; remote (fsspec URL) paths are
  left to it. ``MOEKIT_CHECKPOINT_WRITE_DELAY`` (seconds) pauses every checkpoint write
  between the complete temporary file and the rename: the tests kill runs in the middle of a write with it.
* Reading weights users bring (:func:`read_state_dict`, :func:`load_weights`): our Lightning checkpoints (sharded
  folders too), safetensors or torch state dicts (timm exports), with errors that name the file and the mismatched keys.
* Quantized checkpoints (``scripts/quantize.py``; :mod:`moekit.quantized_checkpoint`): :func:`load_task` reads them.
* Reading training checkpoints (:func:`check_ckpt_path`, :func:`read_training_checkpoint`, :func:`load_task`):
  a missing, corrupt, sharded or foreign checkpoint is a :class:`CheckpointError` naming it, the checkpoints
  beside it and the fix. Resuming from them (``ckpt_path=last`` / ``auto``, the checks against the run that
  resumes) is :mod:`moekit.resume`'s.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor, nn

from moekit.models.export import with_tied_names
from moekit.moe import depth_routers, moe_layers
from moekit.quant.quantize import QUANT_METADATA_KEY
from moekit.utils.atomic import atomic_write

if TYPE_CHECKING:
    from moekit.tasks import MoETask

__all__ = [
    "CheckpointError",
    "TASK_KEY",
    "CLASS_NAMES_KEY",
    "AtomicCheckpointIO",
    "atomic_torch_save",
    "first_non_finite",
    "WRITE_DELAY_ENV",
    "SHARDED_METADATA",
    "read_state_dict",
    "load_weights",
    "head_prefixes",
    "is_sharded_checkpoint",
    "check_ckpt_path",
    "checkpoints_in",
    "read_training_checkpoint",
    "load_task",
    "task_class",
]


log = logging.getLogger("moekit")


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the model."""


TASK_KEY = "moekit_task"
"""The checkpoint entry naming the task class (``module:qualname``), so that one loader reads any task."""
CLASS_NAMES_KEY = "moekit_class_names"
"""The checkpoint entry of an image classifier's label names (``scripts/predict.py`` prints them)."""


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
WRITE_DELAY_ENV = "MOEKIT_CHECKPOINT_WRITE_DELAY"


def _write_delay() -> float:
    value = os.environ.get(WRITE_DELAY_ENV, "")
    if not value:
        return 0.0
    try:
        delay = float(value)
    except ValueError:
        raise ValueError(f"{WRITE_DELAY_ENV}={value!r} must be a number of seconds (or unset)") from None
    if not 0 <= delay < float("inf"):  # NaN and inf too: time.sleep would fail in the middle of a write
        raise ValueError(f"{WRITE_DELAY_ENV}={value!r} must be a finite number of seconds >= 0 (or unset)")
    return delay


class _WriteErrors:
    """A binary file's ``write`` and ``flush`` that remember the ``OSError`` a write raised: ``torch.save`` turns a
    failed write (a full disk, a quota) into a ``RuntimeError`` of its zip writer that has lost the ``errno``."""

    def __init__(self, file: Any):
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` through :func:`moekit.utils.atomic.atomic_write` (pausing
    ``MOEKIT_CHECKPOINT_WRITE_DELAY`` seconds before the rename). Returns the path. A write that fails (a full
    disk) raises its ``OSError``, with ``path`` as its file name, and leaves the file at ``path`` as it was."""
    with atomic_write(path, "wb", pause=_write_delay()) as file:
        writer = _WriteErrors(file)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            err = writer.error
            raise OSError(err.errno, err.strerror or str(err), os.fspath(path)) from None
    return Path(path)


def first_non_finite(checkpoint: Mapping[str, Any]) -> str | None:
    """Where a training checkpoint holds a NaN or an infinity: the first floating tensor of its weights
    (``state_dict``) or optimizer state that is not finite, named; None when all are finite."""

    def bad(value: Any) -> bool:
        return isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all())

    for name, value in (checkpoint.get("state_dict") or {}).items():
        if bad(value):
            return f"the weight {name}"
    for i, optimizer in enumerate(checkpoint.get("optimizer_states") or []):
        for param, state in (optimizer.get("state") or {}).items():
            for key, value in state.items():
                if bad(value):
                    return f"the optimizer state {key!r} of parameter {param} (optimizer {i})"
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic and durable (see the module docstring).

    A checkpoint with a non-finite weight or optimizer state is not written (a :class:`CheckpointError` naming
    the tensor stops the run): it would replace the last good ``last.ckpt`` with weights no run can continue
    from. Loading and removing are Lightning's; checkpoints stay plain ``torch.save`` files.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; it takes none "
                "(call trainer.save_checkpoint(path) without storage_options)"
            )
        bad = first_non_finite(checkpoint)
        if bad is not None:
            raise CheckpointError(
                f"not writing {os.fspath(path)!r}: {bad} is not finite at step {checkpoint.get('global_step')}, so the "
                "checkpoints written before keep the last finite state. Lower task.optimizer.lr or keep "
                "callbacks.non_finite_guard (it skips steps with a non-finite loss or gradient), then resume from them"
            )
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_torch_save(checkpoint, os.fspath(path).removeprefix("file://"))


# ---------------------------------------------------------------------------------------------
# Reading weights
# ---------------------------------------------------------------------------------------------
def read_state_dict(path: str | os.PathLike, prefix: str = "net.") -> dict[str, Tensor]:
    """Tensors of a weights file, keyed like the network's own ``state_dict``.

    Accepts a Lightning checkpoint (its ``state_dict``, with the task's ``net.`` prefix removed; a file, or the
    folder of a sharded one, whose shards are gathered here and whose optimizer states are not read), a
    ``.safetensors`` file, or a torch-saved state dict (optionally under ``state_dict`` / ``model``).
    """
    path = Path(path)
    sharded = is_sharded_checkpoint(path)
    if not (sharded or path.is_file()):
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file); check the path")
    quantized = False
    try:
        if sharded:
            _check_shards(path)
            state = _read_sharded_weights(path)
        elif path.suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            with safe_open(str(path), "pt") as file:
                quantized = QUANT_METADATA_KEY in (file.metadata() or {})
            state = {} if quantized else load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated zip, foreign pickle, safetensors header error, ...
        raise CheckpointError(
            f"checkpoint {str(path)!r} could not be read ({type(err).__name__}: {err}). It is corrupt, truncated or "
            "not a PyTorch/safetensors file; use another checkpoint (e.g. an earlier epoch or last.ckpt)."
        ) from None
    if quantized:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds quantized experts (scripts/quantize.py), which serve inference only; "
            "start from the float training checkpoint it was quantized from"
        )
    if isinstance(state, Mapping) and "state_dict" in state:
        state = state["state_dict"]
    elif isinstance(state, Mapping) and "model" in state and isinstance(state["model"], Mapping):
        state = state["model"]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {str(path)!r} holds no state dict of tensors (found {type(state).__name__})")
    if prefix and any(k.startswith(prefix) for k in state):
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    return dict(state)


def _read_sharded_weights(folder: Path) -> dict[str, Any]:
    """``{"state_dict": ...}`` of a sharded checkpoint folder (``trainer.strategy.state_dict_type=sharded``), its
    shards gathered into whole tensors in this process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # no process group: torch says it reads the shards in one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys({"state_dict"}, checkpoint_id=folder)


def load_weights(
    net: nn.Module,
    state: Mapping[str, Tensor],
    source: str,
    skip_prefixes: tuple[str, ...] = (),
) -> list[str]:
    """Copy ``state`` into ``net``. Keys under ``skip_prefixes`` (a classifier head being replaced)
    are left at their fresh values (logged, with the checkpoint's shapes); any other missing, unexpected or
    mis-shaped key is an error that lists the keys. Returns the names of the skipped parameters."""
    own, state = net.state_dict(), with_tied_names(net, state)
    skipped = [k for k in own if k.startswith(skip_prefixes)] if skip_prefixes else []
    wanted = {k for k in own if k not in skipped}
    given = {k for k in state if not (skip_prefixes and k.startswith(skip_prefixes))}
    missing = sorted(wanted - given)
    unexpected = sorted(given - wanted)
    mismatched = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in wanted & given
        if state[k].shape != own[k].shape
    )
    if missing or unexpected or mismatched:
        parts = []
        for title, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                parts.append(f"{title}: {shown}")
        dense = [name for name, _ in moe_layers(net) if f"{name}.fc2.weight" in given]
        upcycle = (
            f" The checkpoint holds dense MLPs where this model has MoE layers ({', '.join(dense)}): to start an MoE "
            "model from its dense twin, upcycle it (task.init_mode=upcycle; moekit.models.upcycle in Python)."
            if dense
            else ""
        )
        routers = [name for name, _ in depth_routers(net) if not any(k.startswith(f"{name}.") for k in given)]
        if routers and not dense:
            upcycle = (
                f" The checkpoint has no Mixture-of-Depths routers where this model has them ({', '.join(routers)}): "
                "to start from a model without them, upcycle it (task.init_mode=upcycle: the routers start fresh)."
            )
        raise CheckpointError(
            f"checkpoint {source!r} does not fit this model ({type(net).__name__}) - " + "; ".join(parts) + ". "
            "Build the model with the configuration the checkpoint was trained with (its run's results.json names "
            "it), or, for an image classifier of other classes, fine-tune with a new head (the head is then skipped)."
            + upcycle
        )
    net.load_state_dict({k: state[k] for k in wanted}, strict=False)
    if skipped:
        shapes = ", ".join(
            f"{k} {tuple(own[k].shape)} (the checkpoint's: {tuple(state[k].shape) if k in state else 'none'})"
            for k in skipped
        )
        log.info("checkpoint %s: every weight loaded but %s, which start fresh", source, shapes)
    return skipped


def head_prefixes(net: nn.Module) -> tuple[str, ...]:
    """Prefixes of the classifier parameters (timm's ``pretrained_cfg['classifier']``, else ``head``)."""
    cfg: dict | None = getattr(net, "pretrained_cfg", None) or getattr(net, "default_cfg", None)
    classifier = (cfg or {}).get("classifier", "head")
    names = classifier if isinstance(classifier, (list, tuple)) else [classifier]
    return tuple(f"{n}." for n in names)


# ---------------------------------------------------------------------------------------------
# Training checkpoints
# ---------------------------------------------------------------------------------------------
SHARDED_METADATA = "meta.pt"
"""The file of a sharded (FSDP ``state_dict_type=sharded``) checkpoint folder holding everything but
the weights and optimizer states (Lightning's ``ModelParallelStrategy`` layout)."""


def is_sharded_checkpoint(ckpt_path: str) -> bool:
    return (Path(ckpt_path) / SHARDED_METADATA).is_file()


def check_ckpt_path(ckpt_path: str | None, sharded_ok: bool = False) -> None:
    if ckpt_path and sharded_ok and is_sharded_checkpoint(ckpt_path):
        return
    if ckpt_path and is_sharded_checkpoint(ckpt_path):
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} is a sharded checkpoint (one file per rank); only training resumes from it "
            "(with trainer=fsdp). Save full checkpoints to evaluate or export: trainer.strategy.state_dict_type=full"
        )
    if ckpt_path and not Path(ckpt_path).is_file():
        inside = [p.name for p in checkpoints_in(Path(ckpt_path))]  # a folder: the run's checkpoints/ maybe
        what = (
            f"is a folder, not a checkpoint (a sharded one would hold {SHARDED_METADATA}"
            + (f"; the checkpoints in it: {', '.join(inside)})" if inside else ")")
            if Path(ckpt_path).is_dir()
            else "does not exist"
        )
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} {what}; give the path of a .ckpt file (e.g. "
            "<run>/checkpoints/last.ckpt), or ckpt_path=last for the newest checkpoint of this task's runs"
        )


def checkpoints_in(folder: Path) -> list[Path]:
    """The ``.ckpt`` files and sharded checkpoint folders of ``folder``, newest first (``last.ckpt`` first among
    equals). A folder counts as written when its :data:`SHARDED_METADATA` was (rank 0 writes it last); a ``.ckpt``
    folder without one is listed too, so that a resume names it as the damaged checkpoint it is."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("*.ckpt") if p.is_file() or p.is_dir()]
    return sorted(found, key=lambda p: (_written_at(p), p.name == "last.ckpt"), reverse=True)


def _written_at(path: Path) -> float:
    """When a checkpoint was written: a file's modification time, a sharded folder's metadata file's (overwriting
    a folder's files in place leaves the folder's own time as it was)."""
    metadata = path / SHARDED_METADATA
    return (metadata if metadata.is_file() else path).stat().st_mtime


def read_training_checkpoint(ckpt_path: str | Path) -> dict:
    """A Lightning training checkpoint as a dict (the tensors of a zip-format file memory-mapped), or a
    :class:`CheckpointError` that names the checkpoints beside it. A sharded checkpoint folder reads as its
    :data:`SHARDED_METADATA` (all but the weights and optimizer states), once its shards are checked against their
    index (:func:`_check_shards`)."""
    path = Path(ckpt_path)
    try:
        if path.is_dir():
            _check_shards(path)
            checkpoint = torch.load(path / SHARDED_METADATA, map_location="cpu", weights_only=False)
        else:
            # mmap reads torch.save's zip format only: any other file (an empty one, a download's HTML page, the
            # legacy format) is read whole, so that it loads or fails with its own error, not mmap's advice
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(path))
    except Exception as err:
        beside = [p.name for p in checkpoints_in(path.parent) if p.name != path.name]  # listed on failure only
        others = f"; the checkpoints beside it: {', '.join(beside)}" if beside else ""
        raise CheckpointError(
            f"ckpt_path={str(path)!r} could not be read ({_first_sentence(err)}). It is corrupt, truncated or not a "
            "PyTorch checkpoint; resume from another checkpoint (ckpt_path=last takes the one with the most training "
            f"steps that loads) or drop ckpt_path to start afresh{others}"
        ) from None
    required = ("epoch",) if path.is_dir() else ("state_dict", "optimizer_states", "epoch")
    missing = [key for key in required if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is not a Lightning training checkpoint (no {', '.join(missing)}); resume "
            "from a .ckpt written by scripts/train.py, or load plain weights with task.init_from=<file> instead"
        )
    return checkpoint


def _check_shards(folder: Path) -> None:
    """Raise unless every shard file that the folder's torch.distributed.checkpoint index names is there, and
    long enough for the tensors it indexes in it (a kill mid-write leaves one short or missing)."""
    from torch.distributed.checkpoint import FileSystemReader

    ends: dict[str, int] = {}
    for info in FileSystemReader(folder).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = folder / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            raise ValueError(f"its shard {name} is {'missing' if size is None else f'cut at {size} of {end} bytes'}")


def _first_sentence(err: Exception) -> str:
    """``<error type>: <the first sentence of its message>``: the cause, whole, without the advice torch's load
    errors go on with (which would contradict ours)."""
    text = " ".join(str(err).split())
    sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")
    return f"{type(err).__name__}: {sentence}" if sentence else type(err).__name__


def task_class(checkpoint: dict) -> type[MoETask]:
    """The task class a checkpoint names (checkpoints without the entry are image classifiers)."""
    from moekit.tasks import MoETask

    module_name, _, qualname = checkpoint.get(TASK_KEY, "moekit.tasks.classification:ImageClassifier").partition(":")
    if not module_name.startswith("moekit."):
        raise ValueError(f"unknown task {checkpoint[TASK_KEY]!r}")
    cls = getattr(importlib.import_module(module_name), qualname)
    if not (isinstance(cls, type) and issubclass(cls, MoETask)):
        raise ValueError(f"{checkpoint[TASK_KEY]!r} is not a moekit task")
    return cls


def load_task(ckpt_path: str) -> MoETask:
    """The task (image classifier, language model) of a checkpoint written by ``scripts/train.py`` or
    ``scripts/quantize.py``, in eval mode on the CPU, with a clear error for anything else."""
    check_ckpt_path(ckpt_path)
    if str(ckpt_path).endswith(".safetensors"):
        from moekit.quantized_checkpoint import load_quantized_task

        try:
            return load_quantized_task(str(ckpt_path)).eval()
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"ckpt_path={ckpt_path!r} is not a quantized checkpoint that can be loaded ({type(err).__name__}: "
                f"{err}). Write it again with scripts/quantize.py."
            ) from None
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        cls = task_class(checkpoint)
        # The checkpoint holds the trained weights: do not read the run's initial weights file again. Its network
        # runs eagerly in the commands that load it (a compiled training run's would compile again, for one pass).
        module = cls(**{**checkpoint["hyper_parameters"], "init_from": None, "compile": False})
        module.load_state_dict(checkpoint["state_dict"])
        module.on_load_checkpoint(checkpoint)
    except Exception as err:
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} is not a moekit training checkpoint that can be loaded "
            f"({type(err).__name__}: {err}). Pass a .ckpt written by scripts/train.py."
        ) from None
    return module.eval()
