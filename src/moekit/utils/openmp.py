"""How long OpenMP's idle threads spin before they sleep.

After each parallel region (an elementwise op, a large matmul) the threads of torch's OpenMP team busy-wait for the
next one before they sleep: libgomp, which torch's Linux wheels use, spins 300,000 rounds by default, several
milliseconds of a core. Most of torch never notices. moekit's expert products do: a ragged top-k layer runs its
per-expert matmuls on worker threads of its own (:mod:`moekit.moe.cpu_threads`), one per core, and every team thread
still spinning from the op before takes a core's share away from them. On a 2-core AMD EPYC (float32, 256 experts of
hidden 256, top-2, 4096 tokens) one worker then finished its share up to 2x later than the other, and the layer's
expert products took 244-278 ms a step against 204-218 ms with the team asleep (``OMP_WAIT_POLICY=PASSIVE``).

Putting the threads to sleep at once slows other ops that follow one another quickly (transformers' Mixtral block:
1.22-1.46x slower with ``PASSIVE`` than with a short spin); a short spin keeps those fast and frees the cores for
the expert workers within a fraction of a millisecond. :data:`SPIN_ROUNDS` was chosen by measuring
(docs/performance.md#openmps-idle-threads).

OpenMP reads its settings once, when torch loads it, so :func:`limit_spin` only helps a process that imports moekit
before torch; the command-line scripts all do. In a notebook, ``import moekit`` first, or set ``GOMP_SPINCOUNT`` in
the environment. An ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set by the user is left as it is. A torch built with
Intel's OpenMP (``libiomp5``) reads ``KMP_BLOCKTIME`` instead (200 ms by default; ``torch.backends.xeon.run_cpu`` sets
1 ms); moekit leaves that to the user, as it has not been measured here.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["SPIN_ROUNDS", "limit_spin", "spin_setting", "warn_if_spinning"]

SPIN_ROUNDS = 10_000
"""libgomp's ``GOMP_SPINCOUNT`` that moekit sets: rounds of a pause instruction, about 0.3 ms of a core after each
parallel region on a 2-core AMD EPYC, against 9.4 ms for libgomp's default of 300,000."""
_KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # libgomp's waiting policy, set by the user or by limit_spin
_warned = False


def _policy_set() -> bool:
    return any(key in os.environ for key in _KEYS)


def _loaded_runtimes() -> set[str] | None:
    """The OpenMP runtimes in this process (``"libgomp"``, ``"libiomp"``), or None where that cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            return {name for line in maps for name in ("libgomp", "libiomp") if name in line}
    except OSError:  # not Linux
        return None


def limit_spin() -> None:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_ROUNDS` for the OpenMP runtime torch will load, unless a waiting policy
    is set already or the runtime is loaded already."""
    if not _policy_set():
        loaded = _loaded_runtimes()
        if not (loaded if loaded is not None else "torch" in sys.modules):  # torch's import is what loads it
            os.environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)


def spin_setting() -> str:
    """For run records and benchmark headers: ``"GOMP_SPINCOUNT=10000"``, the user's setting, or
    ``"OpenMP's default"`` (moekit was imported after torch)."""
    settings = [f"{key}={os.environ[key]}" for key in _KEYS if key in os.environ]
    return ", ".join(settings) if settings else "OpenMP's default"


def warn_if_spinning() -> None:
    """Warn once per process, when the expert threads first start, that libgomp's default spin is in force: torch
    was imported before moekit and no waiting policy was set. Setting ``GOMP_SPINCOUNT`` to any value silences it."""
    global _warned
    if _warned or _policy_set() or "libgomp" not in (_loaded_runtimes() or ()):
        return
    _warned = True
    warnings.warn(
        "torch was imported before moekit, so OpenMP's idle threads spin for milliseconds after every op and take "
        "cores from the expert threads (a top-2 layer of 256 experts ran 1.13x slower on 2 cores); import moekit "
        f"before torch, or start Python with GOMP_SPINCOUNT={SPIN_ROUNDS} (docs/performance.md#openmps-idle-threads)",
        RuntimeWarning,
        stacklevel=2,
    )
