"""Errors the user fixes (a bad value, a missing file or checkpoint, an output that cannot be written): the
scripts print them as one paragraph and exit with status 1 (:func:`moekit.cli.run_script`)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lightning.fabric.utilities.exceptions import MisconfigurationException

from moekit.checkpoint import CheckpointError

__all__ = ["OutputError", "USER_ERRORS", "check_writable_dir", "storage_errors"]


class OutputError(OSError):
    """An output that cannot be written: a folder that is not writable, a full disk, a quota."""


# Errors caused by the user's input or environment: the scripts print them as one paragraph and exit
# with status 1. Lightning's MisconfigurationException is its own "bad Trainer argument" error.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    CheckpointError,
    OutputError,
    MisconfigurationException,
)

# errno values of a failed write that the user fixes by freeing space or choosing another disk. (Not
# EACCES: a permission error may come from reading the data; output folders are probed before the run.)
_STORAGE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG") if hasattr(errno, name)
)


def check_writable_dir(directory: str | os.PathLike, key: str) -> Path:
    """Create ``directory`` and write a probe file in it, so an output folder that cannot be written
    fails before training (not at the first checkpoint); ``key`` names the setting in the message."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise OutputError(
            f"{key}={str(directory)!r} is not a writable folder ({type(err).__name__}: {err.strerror or err}); "
            f"set {key} to a folder you can write to"
        ) from None
    return directory


@contextlib.contextmanager
def storage_errors(output_dir: str | os.PathLike) -> Iterator[None]:
    """Turn a failed write (disk full, quota, read-only file system) during a run into an
    :class:`OutputError` that names the file and what to do."""
    try:
        yield
    except OSError as err:
        if isinstance(err, OutputError) or err.errno not in _STORAGE_ERRNOS:
            raise
        where = err.filename or output_dir
        raise OutputError(
            f"writing {str(where)!r} failed: {err.strerror or err} ({errno.errorcode.get(err.errno, err.errno)}). "
            "Free disk space (or raise the quota), or set paths.output_dir to a folder "
            "on another disk, then resume with ckpt_path=<paths.output_dir>/checkpoints/last.ckpt"
        ) from None
