"""Atomic file writes: a reader (or a resumed run) sees the old file or the whole new one, never a part.

Every file moekit writes for keeps — checkpoints, ``results.json``, ``metrics.csv``, exported weights, the
Fashion-MNIST download — goes through :func:`atomic_write` (figures and torchvision's CIFAR download are written
directly): a temporary file in the target's folder, flushed and
``fsync``-ed, renamed onto the target with ``os.replace`` (atomic on POSIX within one file system), then the
folder is ``fsync``-ed so the rename survives a power cut. The file gets the permissions a plain
``open(path, "w")`` would give it: a replaced file's own, a new one's from the umask (``mkstemp`` alone would make
it 0600).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "write_text_atomic", "write_json_atomic", "remove_stale_temporaries"]

# The name atomic_write gives its temporary file: ".<target name>.<8 random characters><suffix>" (mkstemp).
_TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (no-op where folders cannot be opened, e.g. Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _permissions(path: Path) -> int:
    """The mode ``open(path, "w")`` leaves ``path`` with: an existing file's own, else ``0o666`` less the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike, mode: str = "w", pause: float = 0.0, suffix: str = ".tmp"
) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing (``mode`` ``"w"`` or ``"wb"``); when the block ends
    without an exception it replaces ``path``, otherwise it is removed and ``path`` is left as it was.
    Missing parent folders are created; inside the block the temporary file's path is ``file.name``.
    ``pause`` seconds pass between the complete temporary file and the rename (tests kill a write there);
    ``suffix`` ends the temporary file's name (``.part.gz``: readers that go by the suffix read it as gzip)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write(mode={mode!r}): use 'w' (text) or 'wb' (bytes)")
    path = Path(path)
    if path.is_dir():  # before the block's work, which os.replace would throw away
        raise IsADirectoryError(
            errno.EISDIR, "a folder stands where the file is to be written; give a file's path", str(path)
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, _permissions(path))
        os.close(fd)
        with open(tmp, mode, **({"newline": ""} if mode == "w" else {})) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        if pause:
            time.sleep(pause)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` by a file holding ``text`` (see :func:`atomic_write`). Returns the path."""
    with atomic_write(path, "w") as file:
        file.write(text)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, data: Mapping[str, Any]) -> Path:
    """Replace ``path`` by ``data`` as indented JSON (see :func:`atomic_write`). Returns the path."""
    text = json.dumps(data, indent=2, default=str, allow_nan=True) + "\n"  # serialise first: a bad value
    return write_text_atomic(path, text)  # leaves the old file untouched


def remove_stale_temporaries(folder: str | os.PathLike, idle_for: float = 0.0) -> list[Path]:
    """Remove the temporary files of :func:`atomic_write` that a process killed in the middle of a write left in
    ``folder`` (``.last.ckpt.k3j9x0ab.tmp``), and return them. Call it at the start of a run, on the folder it
    writes to: such a file is never renamed onto its target, only wastes the disk. In a folder another process may
    still write to, ``idle_for`` seconds keeps the temporaries written to more recently (a write in progress)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    now, stale = time.time(), []
    for path in folder.iterdir():
        if not _TEMPORARY.match(path.name):
            continue
        try:
            if path.is_file() and now - path.stat().st_mtime >= idle_for:
                path.unlink()
                stale.append(path)
        except FileNotFoundError:  # renamed or removed by its writer meanwhile
            continue
    return stale
