"""CPU memory allocator selection.

MoE layers hold many more parameters than the dense layer they replace, so every training step
allocates large gradient tensors. glibc's malloc serves allocations above 32 MB with fresh ``mmap``
pages and returns them on free, so each step pays a page fault per 4 KiB of gradient (on a 2-core
CPU: ~100 ms for the 100 M expert parameters of 256 fine-grained experts). Two remedies, the first that applies:

* tcmalloc, which keeps freed memory for reuse (PyTorch's CPU performance guide recommends it, or jemalloc,
  for training). It must be preloaded when the process starts: :func:`reexec_with_tcmalloc` restarts the
  current Python program with it when the library is installed (Debian: ``apt-get install
  libtcmalloc-minimal4``, which ``make train`` (``make allocator``) does where apt is available). Every
  command-line script does so (:func:`use_fast_allocator`, called by :func:`moekit.cli.run_script`).
* glibc's malloc told to keep large freed blocks too (:func:`tune_glibc_malloc`: no ``mmap`` for large
  blocks, no trimming of the heap's top), which works in a running process: importing :mod:`moekit.moe` does
  it where tcmalloc is not loaded (a notebook, a user's own script, a machine without tcmalloc).

``MOEKIT_ALLOCATOR`` chooses: ``tcmalloc`` (the default: the above), ``glibc`` (tune glibc's malloc in the
process, never restart) or ``system`` (glibc's defaults, untouched). The run record names the allocator
(:func:`active_allocator`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from pathlib import Path

__all__ = [
    "ALLOCATOR_ENV",
    "find_tcmalloc",
    "reexec_with_tcmalloc",
    "active_allocator",
    "tune_glibc_malloc",
    "tune_by_default",
    "use_fast_allocator",
    "add_allocator_argument",
    "apply_allocator",
]

ALLOCATOR_ENV = "MOEKIT_ALLOCATOR"
"""``tcmalloc`` (default), ``glibc`` or ``system``: the allocator moekit's processes run with."""
CHOICES = ("tcmalloc", "glibc", "system")
TUNED = "glibc malloc, tuned"  # what active_allocator() says after tune_glibc_malloc()

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_tuned = False
_REPLACEMENTS = ("tcmalloc", "jemalloc")  # preloadable mallocs that take glibc's place

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


def _loaded_replacements() -> set[str]:
    """The malloc replacements (``"tcmalloc"``, ``"jemalloc"``) loaded into this process, from ``/proc/self/maps``: a
    preload the loader could not find or open does not count. Where that cannot be read (not Linux), ``LD_PRELOAD``
    is taken at its word. Only a library's file name counts (``libtcmalloc_minimal.so.4``), not the folders above
    it: any library loaded from a folder named ``jemalloc-tests`` is not jemalloc."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line[line.index("/") :] for line in maps if "/" in line]  # a mapped file's path
    except OSError:
        paths = os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":")
    names = {path.strip().rsplit("/", 1)[-1] for path in paths}
    return {name for name in _REPLACEMENTS if any(name in file for file in names)}


def active_allocator() -> str:
    """``"tcmalloc"`` or ``"jemalloc"`` when it is loaded into this process (:func:`_loaded_replacements`),
    ``"glibc malloc, tuned"`` after :func:`tune_glibc_malloc`, else ``"system malloc"``."""
    loaded = _loaded_replacements()
    for name in _REPLACEMENTS:
        if name in loaded:
            return name
    return TUNED if _tuned else "system malloc"


def _choice() -> str:
    choice = os.environ.get(ALLOCATOR_ENV, "tcmalloc")
    if choice not in CHOICES:
        raise SystemExit(
            f"{ALLOCATOR_ENV}={choice!r} must be 'tcmalloc' (the default), 'glibc' (tune glibc's malloc in the "
            "process) or 'system' (glibc's defaults)"
        )
    return choice


def tune_glibc_malloc() -> bool:
    """Make glibc's malloc keep the large blocks a training step frees, for the next step to reuse.

    By default glibc serves each allocation above its mmap threshold (at most 32 MB) with fresh pages and unmaps
    them on free, and gives the heap's free top back to the system: every step's expert gradients then fault
    their pages in again. Here large blocks come from the heap (``M_MMAP_MAX = 0``) and the heap keeps its top
    (``M_TRIM_THRESHOLD`` 1 GiB), so the process holds its peak memory, as tcmalloc does. Affects the allocations
    made from then on. Returns True once it has taken effect (also on later calls); False where the process does
    not run glibc's malloc (tcmalloc or jemalloc preloaded, another C library).
    """
    global _tuned
    if _tuned:
        return True
    if _loaded_replacements() or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _tuned = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False
    return _tuned


def tune_by_default() -> None:
    """What importing :mod:`moekit.moe` does: tune glibc's malloc unless ``MOEKIT_ALLOCATOR=system``
    (an unknown value is left to the scripts, which stop on it)."""
    if os.environ.get(ALLOCATOR_ENV, "tcmalloc") in ("tcmalloc", "glibc"):
        tune_glibc_malloc()


def reexec_with_tcmalloc() -> bool:
    """Restart this program with tcmalloc in ``LD_PRELOAD`` if it is installed and not yet loaded.

    Returns False (and does nothing) when tcmalloc is missing or already active, when another malloc replacement
    (jemalloc) is loaded (the user's choice), when the program cannot be run again (read from stdin, typed into
    the interpreter), or off Linux (macOS's loader ignores ``LD_PRELOAD``, and only Linux's ``/proc/self/maps``
    shows whether the preload took); otherwise does not return. Call it first thing in a script's ``main``, before
    any heavy work.
    """
    linux = sys.platform.startswith("linux")
    if not linux or _loaded_replacements() or os.environ.get("MOEKIT_NO_REEXEC") or not _restartable():
        return False
    library = find_tcmalloc()
    if library is None:
        return False
    preload = ":".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    _restart(LD_PRELOAD=preload)
    return True  # unreachable


def _restartable() -> bool:
    """Whether the interpreter's command line runs this program again: a script, ``-m module`` or ``-c code``, not a
    program read from stdin (consumed by now) or an interactive session."""
    return bool(sys.argv and sys.argv[0] not in ("", "-"))


def _restart(**env: str) -> None:
    """Replace this process by the same program with ``env`` added, never to restart again. The interpreter's own
    command line (``sys.orig_argv``: its options, ``-m module`` or ``-c code``) runs it again, with the arguments it
    was given."""
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *sys.orig_argv[1:]]
    os.execve(sys.executable, argv, {**os.environ, **env, "MOEKIT_NO_REEXEC": "1"})


def use_fast_allocator(choice: str | None = None) -> None:
    """What the scripts call first: by ``MOEKIT_ALLOCATOR`` (or ``choice``), restart with tcmalloc when it is
    installed (``tcmalloc``), else tune glibc's malloc (``tcmalloc``, ``glibc``); ``system``: neither."""
    choice = choice or _choice()
    if choice == "tcmalloc":
        reexec_with_tcmalloc()
    if choice in ("tcmalloc", "glibc"):
        tune_glibc_malloc()


def add_allocator_argument(parser) -> None:
    """Add ``--allocator {tcmalloc,glibc,system}`` to an ``argparse`` parser (benchmark scripts)."""
    parser.add_argument(
        "--allocator",
        choices=CHOICES,
        default="tcmalloc",
        help="tcmalloc (default, when installed: restarts the script with it preloaded; else as glibc), glibc "
        "(glibc's malloc tuned to keep large blocks, as in a notebook) or system (glibc's defaults: restarts the "
        "script without the tuning that importing moekit.moe applies)",
    )


def apply_allocator(args) -> None:
    """Act on ``--allocator``, as :func:`use_fast_allocator` does on ``MOEKIT_ALLOCATOR``. ``system`` restarts a
    process whose malloc is already tuned (by the import of :mod:`moekit.moe`) with ``MOEKIT_ALLOCATOR=system``."""
    if args.allocator == "system" and _tuned and not os.environ.get("MOEKIT_NO_REEXEC") and _restartable():
        _restart(**{ALLOCATOR_ENV: "system"})
    use_fast_allocator(args.allocator)
