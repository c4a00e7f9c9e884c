"""A strict reader and a writer for unsigned-byte IDX files (the MNIST / Fashion-MNIST format).

An IDX file is a big-endian header, ``0x00 0x00 <type> <ndim>`` followed by ``ndim`` uint32
dimension sizes, then the data in row-major order. Only the unsigned-byte type (``0x08``) is used by
the (Fashion-)MNIST files, so only it is supported: images have magic number 2051 (3 dims
``[N, rows, cols]``), labels 2049 (1 dim ``[N]``). Files may be gzip-compressed (name ends in ``.gz``).
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["IDX_IMAGES_MAGIC", "IDX_LABELS_MAGIC", "read_idx", "write_idx"]

IDX_UBYTE = 0x08
IDX_IMAGES_MAGIC = (IDX_UBYTE << 8) | 3  # 2051
IDX_LABELS_MAGIC = (IDX_UBYTE << 8) | 1  # 2049


def _read_bytes(path: Path) -> bytes:
    """The (decompressed) content of ``path``; a corrupt or truncated gzip stream is a ValueError."""
    if not path.is_file():
        raise FileNotFoundError(f"IDX file {path} does not exist")
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        return gzip.decompress(path.read_bytes())
    except (EOFError, OSError, zlib.error) as err:
        raise ValueError(f"IDX file {path}: not a complete gzip stream ({err}); delete it and fetch it again") from err


def read_idx(path: str | os.PathLike[str], expected_magic: int) -> np.ndarray:
    """Parse the unsigned-byte IDX file ``path`` (raw or ``.gz``) into a uint8 array of its shape.

    Args:
        path: the file.
        expected_magic: ``IDX_IMAGES_MAGIC`` (2051, gives ``[N, rows, cols]``) or ``IDX_LABELS_MAGIC``
            (2049, gives ``[N]``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: wrong magic number, a zero dimension, or a data section shorter or longer than
            the header announces; the message names the file.
    """
    path = Path(path)
    content = _read_bytes(path)
    if len(content) < 4:
        raise ValueError(f"IDX file {path}: {len(content)} bytes, too short for an IDX header")
    (magic,) = struct.unpack(">I", content[:4])
    if magic != expected_magic:
        raise ValueError(
            f"IDX file {path}: magic number {magic}, expected {expected_magic} "
            f"({'images' if expected_magic == IDX_IMAGES_MAGIC else 'labels'}); is it the right file?"
        )
    ndim = magic & 0xFF
    header_size = 4 + 4 * ndim
    if len(content) < header_size:
        raise ValueError(f"IDX file {path}: truncated header ({len(content)} bytes, need {header_size})")
    dims = struct.unpack(f">{ndim}I", content[4:header_size])
    if 0 in dims:
        raise ValueError(f"IDX file {path}: zero-sized dimension in shape {dims}")
    expected_size = header_size + int(np.prod(dims))
    if len(content) != expected_size:
        problem = "truncated" if len(content) < expected_size else "has trailing bytes"
        raise ValueError(
            f"IDX file {path}: {problem}: {len(content)} bytes, shape {dims} needs {expected_size}; "
            "delete it and fetch it again"
        )
    return np.frombuffer(content, dtype=np.uint8, offset=header_size).reshape(dims)


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    """Write the uint8 ``array`` (1 dim: labels, 3 dims: images) as an IDX file, gzipped if ``path`` ends in ``.gz``."""
    path = Path(path)
    if array.dtype != np.uint8 or array.ndim not in (1, 3):
        raise ValueError(f"write_idx: need a uint8 array with 1 or 3 dims, got {array.dtype} with shape {array.shape}")
    header = struct.pack(f">I{array.ndim}I", (IDX_UBYTE << 8) | array.ndim, *array.shape)
    content = header + np.ascontiguousarray(array).tobytes()
    path.write_bytes(gzip.compress(content, compresslevel=1) if path.suffix == ".gz" else content)
    return path
