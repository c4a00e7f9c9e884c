"""Per-expert matmuls spread over the CPU's threads, one expert per thread at a time.

An expert of ragged dispatch holds a few dozen to a few hundred rows. One BLAS call on such a product, split over all
intra-op threads, runs far below the machine's matmul rate: each thread gets a sliver of a small product and waits for
the others at its end. Here each of ``torch.get_num_threads()`` worker threads runs whole experts' products on one
intra-op thread, the way ``torch.bmm`` runs equal groups, taking the next expert as it finishes one, the experts in
order of falling rows (longest first): the threads end within about the smallest expert's time of each other, however
the rows fall, and a thread slowed by other work takes fewer. The workers start once per process and thread count
(again after a fork); a worker's one-thread setting is its own (OpenMP's and MKL's thread-local settings), the calling
thread keeps its own.

The workers share the cores with torch's own OpenMP team, whose idle threads spin for milliseconds after each parallel
region before they sleep (libgomp's default): one worker then ran at half speed, up to 2x longer than the other.
Importing moekit before torch shortens that spin (:mod:`moekit.utils.openmp`).

The work runs in the calling thread, one expert after another, where threads cannot help or would hide the work: a
device other than the CPU, one intra-op thread, fewer non-empty experts per thread than ``MIN_EXPERTS_PER_THREAD`` of
:mod:`moekit.moe.kernel_choices` (fewer, larger products split well over the BLAS's own threads; bf16 rows on a CPU
with AMX from fewer experts of enough rows, :func:`spreads`; the measurements are there), or a ``TorchDispatchMode``
active (the FLOP counter's, which sees only the calling thread's operators).
:func:`for_each_part` hands the same workers other work of serial kernels (a large dropout mask's chunks).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from moekit.utils.openmp import warn_if_spinning

from . import kernel_choices

__all__ = ["for_each_expert", "for_each_part", "longest_first", "spreads"]


class _Workers:
    """``n`` threads, each with one intra-op thread (``usable`` False if a thread did not take that setting)."""

    def __init__(self, n: int) -> None:
        warn_if_spinning()
        self.n = n
        self.pool = ThreadPoolExecutor(n, thread_name_prefix="moekit-experts")
        ready = threading.Barrier(n + 1)
        # every worker waits at the barrier until all n exist: each of the n threads initialises once
        inits = [self.pool.submit(self._init_worker, ready) for _ in range(n)]
        ready.wait()
        torch.set_num_threads(n)  # a worker's set_num_threads(1) also set the process default; restore it
        self.usable = all(init.exception() is None and init.result() == 1 for init in inits)

    @staticmethod
    def _init_worker(ready: threading.Barrier) -> int:
        try:
            torch.set_num_threads(1)
            # ATen sets a new thread's count from the process default once, at the first call that asks for it: ask
            # now, while the default is 1 (the caller restores it after the barrier)
            return torch.get_num_threads()
        finally:
            ready.wait()


# One set of workers per thread count, kept for the process's life: Python threads that run with different counts
# (two models, each set up with its own) each keep theirs, and none shuts down workers another thread is using
_workers: dict[int, _Workers] = {}
_lock = threading.Lock()


def _get_workers(n: int) -> _Workers:
    with _lock:
        if n not in _workers:
            _workers[n] = _Workers(n)
        return _workers[n]


def _forget_workers() -> None:
    global _workers, _lock
    _workers = {}  # a forked child has none of its parent's threads,
    _lock = threading.Lock()  # and a lock another thread held at the fork would stay held


os.register_at_fork(after_in_child=_forget_workers)


def longest_first(costs: Sequence[int]) -> list[int]:
    """The experts of ``costs > 0`` in the order the workers take them: falling cost, ties in expert order."""
    return sorted((e for e, cost in enumerate(costs) if cost > 0), key=lambda e: -costs[e])


def _run(work: Callable[[int], None], order: Sequence[int], workers: _Workers | None) -> None:
    """``work(i)`` for each ``i`` of ``order``: each worker takes the next one as it finishes one, or all run in the
    calling thread where ``workers`` is None; without autograd recording, in the caller's inference mode. After an
    error no worker takes another, and it reaches the caller once every worker has ended the one it was running."""
    inference = torch.is_inference_mode_enabled()
    items, lock, failed = iter(order), threading.Lock(), threading.Event()

    def run() -> None:
        with torch.inference_mode(inference), torch.no_grad():
            while not failed.is_set():
                with lock:
                    i = next(items, None)
                if i is None:
                    return
                try:
                    work(i)
                except BaseException:
                    failed.set()
                    raise

    if workers is None:
        run()
        return
    futures = [workers.pool.submit(run) for _ in range(workers.n)]
    wait(futures)  # every worker ends before an error reaches the caller: none writes the outputs after that
    for future in futures:
        future.result()


def _usable_workers(spread: bool) -> _Workers | None:
    """The workers for this thread count where ``spread`` and no dispatch mode is active, else None."""
    workers = _get_workers(torch.get_num_threads()) if spread and torch._C._len_torch_dispatch_stack() == 0 else None
    return workers if workers is not None and workers.usable else None


def spreads(costs: Sequence[int], dtype: torch.dtype, threads: int) -> bool:
    """Whether experts of ``costs`` rows each, in ``dtype``, go over ``threads`` threads: at least
    ``MIN_EXPERTS_PER_THREAD`` non-empty experts a thread, or for bf16 rows, where this CPU's matrix units have entries,
    ``BF16_MIN_EXPERTS_PER_THREAD`` of ``BF16_SPREAD_MIN_ROWS`` rows or more on average."""
    busy = [cost for cost in costs if cost > 0]
    if len(busy) >= kernel_choices.MIN_EXPERTS_PER_THREAD * threads:
        return True
    if dtype != torch.bfloat16:
        return False
    units = kernel_choices.cpu_matrix_units()
    per_thread = kernel_choices.BF16_MIN_EXPERTS_PER_THREAD.get(units)
    rows = kernel_choices.BF16_SPREAD_MIN_ROWS.get(units, 0)
    return per_thread is not None and len(busy) >= per_thread * threads and sum(busy) >= rows * len(busy)


def for_each_expert(
    work: Callable[[int], None], costs: Sequence[int], device: torch.device, dtype: torch.dtype = torch.float32
) -> None:
    """Call ``work(e)`` for every expert ``e`` with ``costs[e] > 0`` (its rows): over the CPU's threads, longest
    first (:func:`longest_first`), when ``device`` is the CPU and :func:`spreads` says so for rows of ``dtype``, else
    in expert order in the calling thread. ``work`` writes into preallocated tensors (``out=``); it runs without
    autograd recording, in the caller's inference mode. After an error raised by ``work`` no thread starts another
    expert, and the error reaches the caller once every thread has ended the expert it was running."""
    n = torch.get_num_threads()
    workers = _usable_workers(device.type == "cpu" and n > 1 and spreads(costs, dtype, n))
    order = [e for e, cost in enumerate(costs) if cost > 0] if workers is None else longest_first(costs)
    _run(work, order, workers)


def for_each_part(work: Callable[[int], None], parts: int) -> None:
    """Call ``work(i)`` for ``i`` in ``range(parts)``, independent pieces of one CPU operation that each run on one
    thread (a serial kernel, such as a random generator's), over the CPU's intra-op threads, each taking the next piece
    as it finishes one; in the calling thread where there is one thread or one piece. As :func:`for_each_expert`, it
    returns once every piece has run."""
    n = torch.get_num_threads()
    _run(work, range(parts), _usable_workers(n > 1 and parts > 1))
