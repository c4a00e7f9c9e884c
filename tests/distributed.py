"""Run a function on ``world`` CPU processes joined by a gloo process group (tests only).

``spawn(fn, world, *args)`` forks the processes (``torch.multiprocessing.start_processes``): each rank starts as a
copy of the test process, with torch and moekit already imported, and runs single-threaded (no OpenMP pool is
used across the fork); an exception in any rank fails the call with its traceback.
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


def spawn(fn, world: int, *args) -> None:
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="fork")
