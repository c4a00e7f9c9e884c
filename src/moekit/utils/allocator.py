"""CPU memory allocator selection.

MoE layers hold many more parameters than the dense layer they replace, so every training step
allocates large gradient tensors. glibc's malloc serves allocations above 32 MB with fresh ``mmap``
pages and returns them on free, so each step pays a page fault per 4 KiB of gradient (on a 2-core
CPU: ~100 ms for the 100 M expert parameters of 256 fine-grained experts). tcmalloc keeps freed
memory for reuse; PyTorch's CPU performance guide recommends it (or jemalloc) for training.
:func:`reexec_with_tcmalloc` restarts the current Python program with tcmalloc preloaded when the
library is installed (Debian: ``apt-get install libtcmalloc-minimal4``, which ``make install`` does where
apt is available). Every command-line script does so (:func:`use_fast_allocator`, called by
:func:`moekit.cli.run_script`) unless ``MOEKIT_ALLOCATOR=system``; the run record names the allocator.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

__all__ = [
    "ALLOCATOR_ENV",
    "find_tcmalloc",
    "reexec_with_tcmalloc",
    "active_allocator",
    "use_fast_allocator",
    "add_allocator_argument",
    "apply_allocator",
]

ALLOCATOR_ENV = "MOEKIT_ALLOCATOR"
"""``tcmalloc`` (default) or ``system``: the allocator the command-line scripts run with."""

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc shared library, or None."""
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    name = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return name


def active_allocator() -> str:
    """``"tcmalloc"`` when it is preloaded into this process, else ``"system malloc"``."""
    return "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "system malloc"


def reexec_with_tcmalloc() -> bool:
    """Restart this program with tcmalloc in ``LD_PRELOAD`` if it is installed and not yet loaded.

    Returns False (and does nothing) when tcmalloc is missing or already active; otherwise does not
    return. Call it first thing in a script's ``main``, before any heavy work.
    """
    if active_allocator() == "tcmalloc" or os.environ.get("MOEKIT_NO_REEXEC"):
        return False
    library = find_tcmalloc()
    if library is None:
        return False
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env["MOEKIT_NO_REEXEC"] = "1"  # never loop, even if the preload silently fails
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return True  # unreachable


def use_fast_allocator() -> None:
    """What the scripts call first: restart with tcmalloc (when installed) unless ``MOEKIT_ALLOCATOR=system``."""
    choice = os.environ.get(ALLOCATOR_ENV, "tcmalloc")
    if choice not in ("tcmalloc", "system"):
        raise SystemExit(f"{ALLOCATOR_ENV}={choice!r} must be 'tcmalloc' (the default) or 'system'")
    if choice == "tcmalloc":
        reexec_with_tcmalloc()


def add_allocator_argument(parser) -> None:
    """Add ``--allocator {tcmalloc,system}`` to an ``argparse`` parser (benchmark scripts)."""
    parser.add_argument(
        "--allocator",
        choices=["tcmalloc", "system"],
        default="tcmalloc",
        help="tcmalloc (default, when installed: restarts the script with it preloaded) or the system malloc",
    )


def apply_allocator(args) -> None:
    """Act on ``--allocator``: restart with tcmalloc unless ``system`` was asked for."""
    if args.allocator == "tcmalloc":
        reexec_with_tcmalloc()
