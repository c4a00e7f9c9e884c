"""Run a function on ``world`` CPU processes joined by a gloo process group (tests only).

``spawn(fn, world, *args)`` starts the ranks (``torch.multiprocessing.start_processes``) from the tests' fork server
(tests/fork_server.py), so nothing a test left in the test process reaches them. Each rank imports ``fn``'s test
module, runs single-threaded, and an exception in any rank fails the call with its traceback.
"""

import os
import socket

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fork_server


class Regression(L.LightningModule):
    """A linear layer, a top-2 MoE layer of 4 experts (``num_shared_experts`` shared) and a linear layer, of width 8,
    trained by SGD at ``lr`` without momentum: the expert-parallel strategies' tests."""

    lr, num_shared_experts = 0.5, 0

    def __init__(self) -> None:
        super().__init__()
        from moekit.moe import TopKMoE

        torch.manual_seed(0)
        moe = TopKMoE(8, 16, num_experts=4, top_k=2, num_shared_experts=self.num_shared_experts)
        self.net = nn.Sequential(nn.Linear(8, 8), moe, nn.Linear(8, 8))

    def configure_model(self) -> None:
        self.trainer.strategy.parallelize(self)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


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
