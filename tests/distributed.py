"""Run a function on ``world`` CPU processes joined by a gloo process group (tests only).

``spawn(fn, world, *args)`` starts the ranks (``torch.multiprocessing.start_processes``) from a fork server: a
process started once per pytest worker, which imports torch, Lightning and moekit and then only forks. So nothing a
test left in the test process reaches the ranks: an OpenMP pool or autograd worker threads that do not survive a fork
(a rank forked from the test process after tests/test_compile.py's tracing could abort in its backward pass, or be
refused it), torch's deterministic mode, a process group. Each rank imports ``fn``'s test module, runs
single-threaded, and an exception in any rank fails the call with its traceback.
"""

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


# Imported by the fork server before it forks any rank: moekit first, as the scripts do (OpenMP's idle spin).
PRELOAD = ["moekit", "torch", "lightning", "moekit.moe", "moekit.tasks", "distributed"]


def spawn(fn, world: int, *args) -> None:
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="forkserver")
