"""Run a function on ``world`` CPU processes joined by a gloo process group (tests only).

``spawn(fn, world, *args)`` starts the ranks (``torch.multiprocessing.start_processes``) from the tests' fork server
(tests/fork_server.py), so nothing a test left in the test process reaches them. Each rank imports ``fn``'s test
module, runs single-threaded, and an exception in any rank fails the call with its traceback.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fork_server


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
    fork_server.context()  # sets the server's imports before it starts
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="forkserver")
