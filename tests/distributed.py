"""Run a function on ``world`` CPU processes joined by a gloo process group (tests only).

``spawn(fn, world, *args)`` forks the processes (``torch.multiprocessing.start_processes``): each rank starts as a
copy of the test process, with torch and moekit already imported, and runs single-threaded (no OpenMP pool is
used across the fork); an exception in any rank fails the call with its traceback. Where a forked process could not
run a backward pass (torch refuses autograd in a child forked after the parent's autograd engine started its
worker threads, as Dynamo's tracing of some layers does in tests/test_compile.py, which may run earlier in the same
pytest worker), the ranks are forked from a fresh server process instead (``forkserver``, which imports torch,
Lightning and moekit once), and import ``fn``'s test module.
"""

import faulthandler
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _backward() -> None:
    faulthandler.disable()  # torch's refusal can abort the process: no thread dump in the test's output
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    torch.ones(1, requires_grad=True).sum().backward()


_FORK_RUNS_AUTOGRAD = [True]  # once it cannot, it never can again in this process


def _fork_runs_autograd() -> bool:
    if _FORK_RUNS_AUTOGRAD[0]:
        probe = mp.get_context("fork").Process(target=_backward)
        probe.start()
        probe.join()
        _FORK_RUNS_AUTOGRAD[0] = probe.exitcode == 0
    return _FORK_RUNS_AUTOGRAD[0]


def spawn(fn, world: int, *args) -> None:
    if _fork_runs_autograd():
        method = "fork"
    else:  # fork from a fresh server process that has imported the heavy modules once
        method = "forkserver"
        mp.get_context(method).set_forkserver_preload(
            ["moekit", "torch", "lightning", "moekit.moe", "moekit.tasks", "distributed"]
        )
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method=method)
