"""Expert parallelism vs replicated experts: bytes moved and step time of one MoE layer trained data
parallel on ``W`` CPU processes (gloo), measured in one run.

Two arms, the same layer, tokens and weights on every rank:

* ``replicated`` - every rank holds all experts (DDP): its tokens never leave it, and DDP all-reduces
  every gradient, the experts' included, after backward.
* ``expert-parallel`` - the experts are split over the ``W`` ranks (:class:`~moekit.parallel.MoEDDPStrategy`
  with ``expert_parallel_size=W``): tokens travel to their expert's rank and back by all-to-all, DDP
  all-reduces only the gradients outside the experts (router, norms).

A step is forward + backward + gradient sync of ``--layers`` stacked layers (``x + moe(norm(x))``)
on ``--tokens`` tokens per rank; the first ``--warmup`` steps are left out. Bytes are counted where
they leave a rank: all-to-all rows bound for other ranks, and ``2 (W - 1) / W`` of each all-reduced
bucket (a ring all-reduce). The cost model for GPUs (bytes per token and layer) is in docs/distributed.md.

    python scripts/bench_parallel.py                 # W = 2 and 4, Soft MoE and top-2 (~2 min, 2 cores)
    python scripts/bench_parallel.py --worlds 2 --steps 5 --warmup 1   # a smoke run

On a 2-core machine 4 processes share 2 cores (1 thread each): step times there measure
oversubscription as much as communication; the byte counts do not depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from moekit.moe import SoftMoE, TopKMoE
from moekit.moe import all_to_all as exchange
from moekit.parallel import new_expert_parallel_groups, shard_experts, sharded_expert_banks

LAYERS = {
    "soft_moe": lambda a: SoftMoE(a.dim, a.hidden, num_experts=a.experts, slots_per_expert=1),
    "top2": lambda a: TopKMoE(a.dim, a.hidden, num_experts=a.experts, top_k=2, capacity_factor=1.25),
}


class Stack(nn.Module):
    def __init__(self, make_layer, depth: int, dim: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.moes = nn.ModuleList(make_layer() for _ in range(depth))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


class ByteCounter:
    """Bytes leaving this rank: all-to-all rows for other ranks, ring all-reduce traffic. Wraps
    ``torch.distributed.all_to_all_single`` for the life of the process (create one per process)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.reset()
        original = dist.all_to_all_single

        def counting_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            if input_split_sizes is not None and input.dim() > 1:  # token rows (not the count exchange)
                row = input[0].numel() * input.element_size() if input.shape[0] else 0
                local_rank = dist.get_rank(group)
                self.all_to_all += row * (sum(input_split_sizes) - input_split_sizes[local_rank])
            return original(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        exchange.dist.all_to_all_single = counting_all_to_all  # what moekit.moe.all_to_all calls

    def reset(self) -> None:
        self.all_to_all = self.all_reduce = 0

    def ddp_hook(self, state, bucket):
        buffer = bucket.buffer()
        self.all_reduce += int(2 * (self.world - 1) / self.world * buffer.numel() * buffer.element_size())
        return allreduce_hook(state, bucket)


def _arm(counter: ByteCounter, world: int, args, layer: str, expert_parallel: bool) -> tuple[float, float, float]:
    torch.manual_seed(0)
    model = Stack(lambda: LAYERS[layer](args), args.layers, args.dim)
    if expert_parallel:
        shard_experts(model, new_expert_parallel_groups(world))
        ignore = {id(p) for bank in sharded_expert_banks(model).values() for p in bank.parameters()}
        names = [n for n, p in model.named_parameters() if id(p) in ignore]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, counter.ddp_hook)
    x = torch.randn(args.tokens // 64, 64, args.dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            counter.reset()
        dist.barrier()
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        times.append(time.perf_counter() - start)
        ddp.zero_grad(set_to_none=True)
    return statistics.median(times[args.warmup :]), counter.all_to_all / args.steps, counter.all_reduce / args.steps


def _worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter = ByteCounter(world)
    for layer in args.layer:
        for expert_parallel in (False, True):
            step, a2a, allreduce = _arm(counter, world, args, layer, expert_parallel)
            if rank == 0:
                results.append((world, layer, expert_parallel, step, a2a, allreduce))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layer", nargs="+", choices=sorted(LAYERS), default=["soft_moe", "top2"])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank (sequences of 64)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores shared by the processes")
    args = parser.parse_args()
    for name in ("experts", "dim", "hidden", "layers", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be positive")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} must be 0 or more")
    if args.tokens < 64 or args.tokens % 64:  # else the ranks run fewer tokens than the per-token figures divide by
        parser.error(f"--tokens={args.tokens} must be a positive multiple of 64 (sequences of 64 tokens)")
    bad = [w for w in args.worlds if w < 1 or args.experts % w]
    if bad:
        parser.error(f"--worlds {' '.join(map(str, bad))}: each must be a divisor of --experts={args.experts}")

    results = mp.Manager().list()
    for world in args.worlds:
        # Forked: the ranks start with torch imported (the parent has run no parallel region yet).
        worker_args = (world, _free_port(), args, results)
        mp.start_processes(_worker, args=worker_args, nprocs=world, join=True, start_method="fork")

    expert_params = 2 * args.dim * args.hidden + args.hidden + args.dim
    print(
        f"\n{args.layers} x {args.experts} experts ({args.dim} -> {args.hidden} -> {args.dim}, "
        f"{expert_params * args.experts * 4 / 2**20:.1f} MiB of float32 expert weights per layer), "
        f"{args.tokens} tokens per rank, CPU gloo, torch {torch.__version__}, {os.cpu_count()} cores\n"
    )
    header = f"{'W':>2} {'layer':<9} {'experts':<16} {'step ms':>8} {'all-to-all MB':>14} {'all-reduce MB':>14}"
    print(header + f" {'MB / token / layer':>19} {'step vs replicated':>19}")
    rows = {(w, layer, ep): (step, a2a, ar) for w, layer, ep, step, a2a, ar in results}
    for world, layer, ep, step, a2a, ar in results:
        base = rows[(world, layer, False)][0]
        per_token = (a2a + ar) / args.tokens / args.layers / 2**20
        print(
            f"{world:>2} {layer:<9} {'expert-parallel' if ep else 'replicated':<16} {step * 1e3:>8.1f} "
            f"{a2a / 2**20:>14.2f} {ar / 2**20:>14.2f} {per_token:>19.4f} {step / base:>18.2f}x"
        )


if __name__ == "__main__":
    main()
