"""Atomic checkpoint files: a crash or a kill while a checkpoint is written never damages the last good one.

:class:`AtomicCheckpointIO` is the trainer's ``CheckpointIO`` (``configs/trainer/default.yaml``:
``plugins``), so every file Lightning writes (``last.ckpt``, ``epoch_XXX.ckpt``,
``trainer.save_checkpoint``) goes through it. A local checkpoint is serialised into a temporary file
in the destination folder, flushed and ``fsync``-ed, then renamed onto the final name with
``os.replace`` (atomic on POSIX within one file system) and the folder is ``fsync``-ed so the rename
itself survives a power cut. Readers see either the previous complete file or the new complete file.

Lightning's own ``TorchCheckpointIO`` writes through an fsspec transaction (also a temporary file and
a move) but never ``fsync``-s, so after a machine crash the renamed file can be empty. Remote
(fsspec URL) paths are left to it.

Setting the environment variable ``MOEKIT_CHECKPOINT_WRITE_DELAY`` to a number of seconds makes every
write pause that long between the complete temporary file and the rename: the tests use it to kill a
run in the middle of a checkpoint write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "WRITE_DELAY_ENV", "atomic_torch_save"]

WRITE_DELAY_ENV = "MOEKIT_CHECKPOINT_WRITE_DELAY"


def _write_delay() -> float:
    value = os.environ.get(WRITE_DELAY_ENV, "")
    if not value:
        return 0.0
    try:
        delay = float(value)
    except ValueError:
        raise ValueError(f"{WRITE_DELAY_ENV}={value!r} must be a number of seconds (or unset)") from None
    if delay < 0:
        raise ValueError(f"{WRITE_DELAY_ENV}={value!r} must be >= 0 seconds")
    return delay


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (no-op where folders cannot be opened, e.g. Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` through a temporary file in the same folder, ``fsync`` and ``os.replace``.

    The file keeps the permissions a plain ``open(path, "wb")`` would give it. Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        delay = _write_delay()
        if delay:
            time.sleep(delay)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic and durable (see the module docstring).

    Loading and removing are Lightning's; checkpoints stay plain ``torch.save`` files.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; it takes none "
                "(call trainer.save_checkpoint(path) without storage_options)"
            )
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_torch_save(checkpoint, os.fspath(path).removeprefix("file://"))
