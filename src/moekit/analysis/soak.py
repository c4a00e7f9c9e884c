"""Soak test: thousands of training steps of a small MoE model with the statistics callbacks on, recording
resident memory and throughput, to catch the leaks and slow-downs that short runs do not show.

The run is the training template's own, built from the composed config like ``scripts/train.py`` builds
it (:func:`moekit.commands.train.train` without the test phase): ``experiment=tokens_choice_vit`` (top-2 of 8 experts
with capacity factor 1.25, so the capacity tuner has layers to tune) narrowed by the options below, on a
fake Fashion-MNIST written to a temporary folder, with ``callbacks=[default,capacity_tuner]`` (expert-load
monitor, throughput logger, non-finite guard, learning-rate monitor, pre-emption handler, ``last.ckpt``
every epoch and every 100 steps, best checkpoint by ``val/acc``, capacity tuner), CSV and TensorBoard
logs, and validation every epoch. Every ``--every`` steps a callback records the resident set size of
the process (``/proc/self/statm``) and the wall time.

The verdict compares the last quarter of the run with the first, both after ``--warmup`` steps (the
allocator's pools, the first validation and checkpoint fill up there): memory growth is the median RSS
of the last quarter's records minus the first quarter's, throughput is each quarter's steps over its
wall time (validation and checkpoint writes included, as a user sees them). It passes when the growth
is at most ``--max-growth`` of the first quarter's RSS and the last quarter runs at least
``--min-throughput-ratio`` times as fast as the first; the exit status is 0 on a pass, 1 otherwise.

    python scripts/soak.py                                    # 5,000 steps (~5 min on 2 cores)
    python scripts/soak.py --steps 600 --warmup 100           # a smoke run
    python scripts/soak.py model.embed_dim=128 data.batch_size=128   # any override of configs/train.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
from lightning import Callback, LightningModule, Trainer
from omegaconf import DictConfig

from moekit.commands.common import choose_precision
from moekit.configs import CONFIG_DIR, compose, instantiate, instantiate_group
from moekit.data.fashion_mnist import write_fake_fashion_mnist
from moekit.utils.allocator import active_allocator, add_allocator_argument, apply_allocator
from moekit.utils.machine import machine_info

VAL_IMAGES = 256
MIB = 2**20


def rss_bytes() -> int:
    """The resident set size of this process in bytes (Linux: ``/proc/self/statm``)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except FileNotFoundError:
        raise SystemExit("the soak test reads /proc/self/statm: run it on Linux") from None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Record:
    """One sample of the run: the optimizer ``step`` done, the wall ``time`` (s, ``perf_counter``) and
    the resident set size ``rss`` (bytes) at that step's end."""

    step: int
    time: float
    rss: int


class ResourceRecorder(Callback):
    """Appends a :class:`Record` to ``records`` at the end of every ``every``-th optimizer step; placed
    last, so every other callback's work of that step is done."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.records: list[Record] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self.every == 0:
            self.records.append(Record(trainer.global_step, time.perf_counter(), rss_bytes()))


@dataclass(frozen=True)
class Quarter:
    """The records of one quarter of the measured span: from step ``start`` (exclusive) to ``end``.
    ``rss_median`` in bytes over its records; ``steps_per_sec`` = (end - start) / its wall time."""

    start: int
    end: int
    rss_median: float
    steps_per_sec: float


@dataclass(frozen=True)
class Verdict:
    """The soak's figures: ``first`` / ``last`` quarter, ``growth`` = last - first median RSS (bytes),
    ``growth_fraction`` = growth / first median RSS, ``throughput_ratio`` = last / first steps per second,
    and whether each stays within its bound."""

    first: Quarter
    last: Quarter
    growth: float
    growth_fraction: float
    throughput_ratio: float
    memory_ok: bool
    throughput_ok: bool

    @property
    def passed(self) -> bool:
        return self.memory_ok and self.throughput_ok


def quarter(records: list[Record], start: int, end: int) -> Quarter:
    """The :class:`Quarter` of ``records`` between steps ``start`` and ``end`` (both must be record steps)."""
    at = {r.step: r for r in records}
    inside = [r.rss for r in records if start < r.step <= end]
    seconds = at[end].time - at[start].time
    return Quarter(start, end, statistics.median(inside), (end - start) / seconds)


def verdict(records: list[Record], warmup: int, max_growth: float, min_throughput_ratio: float) -> Verdict:
    """Compare the first and last quarter of the records after ``warmup`` (see the module docstring)."""
    steps = [r.step for r in records if r.step >= warmup]
    if len(steps) < 9:
        raise ValueError(f"{len(steps)} records after the warm-up; a verdict needs at least 9 (more steps or --every)")
    bounds = [steps[round(i * (len(steps) - 1) / 4)] for i in range(5)]
    first, last = quarter(records, bounds[0], bounds[1]), quarter(records, bounds[3], bounds[4])
    growth = last.rss_median - first.rss_median
    ratio = last.steps_per_sec / first.steps_per_sec
    return Verdict(
        first,
        last,
        growth,
        growth / first.rss_median,
        ratio,
        memory_ok=growth <= max_growth * first.rss_median,
        throughput_ok=ratio >= min_throughput_ratio,
    )


def compose_run_config(args: argparse.Namespace, data_root: Path, output_dir: Path) -> DictConfig:
    """The training config of the soak run: ``configs/train.yaml`` with the soak's overrides, then the user's."""
    overrides = [
        f"experiment={args.experiment}",
        "callbacks=[default,capacity_tuner]",
        "logger=many",
        f"data.root={data_root}",
        f"data.val_size={VAL_IMAGES}",
        f"data.batch_size={args.batch_size}",
        f"++model.embed_dim={args.embed_dim}",  # ++: set or add (the model config lists what differs from timm)
        f"++model.depth={args.depth}",
        f"trainer.max_steps={args.steps}",
        f"trainer.max_epochs={args.steps // args.steps_per_epoch + 1}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        f"seed={args.seed}",
        f"paths.root_dir={CONFIG_DIR.parent}",
        *args.overrides,
    ]
    return compose(CONFIG_DIR, "train", overrides, output_dir)


def soak(args: argparse.Namespace, work_dir: Path) -> list[Record]:
    """Train the soak run in ``work_dir`` (data and outputs); the records of its resources."""
    data_root = write_fake_fashion_mnist(
        work_dir / "fashion-mnist", n_train=args.steps_per_epoch * args.batch_size + VAL_IMAGES, n_test=64
    )
    cfg = compose_run_config(args, data_root, work_dir / "run")
    choose_precision(cfg)
    L.seed_everything(cfg.seed, verbose=False)
    datamodule = instantiate(cfg.data, _convert_="all")
    module = instantiate(cfg.task, net=cfg.model, _recursive_=False)
    recorder = ResourceRecorder(args.every)
    callbacks = [*instantiate_group(cfg.callbacks, "callbacks"), recorder]
    trainer: Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=instantiate_group(cfg.logger, "logger"))
    print(f"# {sum(p.numel() for p in module.parameters()) / 1e6:.2f} M parameters; outputs in {work_dir / 'run'}")
    trainer.fit(module, datamodule=datamodule)
    if trainer.global_step != args.steps:
        raise SystemExit(f"the run stopped at step {trainer.global_step} of {args.steps}")
    return recorder.records


def _table(records: list[Record], rows: int) -> str:
    """A Markdown table of about ``rows`` evenly spaced records: step, RSS, steps/s since the previous row."""
    keep = sorted({round(i * (len(records) - 1) / (rows - 1)) for i in range(rows)})
    lines = ["| step | RSS MiB | steps/s |", "|---:|---:|---:|"]
    for previous, index in zip([None, *keep], keep):
        record = records[index]
        speed = ""
        if previous is not None:
            before = records[previous]
            speed = f"{(record.step - before.step) / (record.time - before.time):.2f}"
        lines.append(f"| {record.step} | {record.rss / MIB:.1f} | {speed} |")
    return "\n".join(lines)


def _report(records: list[Record], result: Verdict, args: argparse.Namespace) -> str:
    first, last = result.first, result.last
    ok = {True: "ok", False: "FAIL"}
    return "\n".join(
        [
            _table(records, args.table_rows),
            "",
            "| quarter | steps | RSS median MiB | steps/s |",
            "|---|---|---:|---:|",
            f"| first | {first.start}-{first.end} | {first.rss_median / MIB:.1f} | {first.steps_per_sec:.2f} |",
            f"| last | {last.start}-{last.end} | {last.rss_median / MIB:.1f} | {last.steps_per_sec:.2f} |",
            "",
            f"memory growth first -> last quarter: {result.growth / MIB:+.1f} MiB ({result.growth_fraction:+.2%}; "
            f"bound {args.max_growth:.0%}): {ok[result.memory_ok]}",
            f"throughput last / first quarter: {result.throughput_ratio:.3f} "
            f"(bound >= {args.min_throughput_ratio}): {ok[result.throughput_ok]}",
            f"verdict: {'PASS' if result.passed else 'FAIL'}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of configs/train.yaml, applied last")
    parser.add_argument("--steps", type=int, default=5000, help="optimizer steps in all")
    parser.add_argument("--warmup", type=int, default=200, help="steps left out of the comparison")
    parser.add_argument("--every", type=int, default=50, help="steps between two records")
    parser.add_argument("--steps-per-epoch", type=int, default=200, help="training images / batch size")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4, help="blocks; the second half are MoE blocks")
    parser.add_argument("--experiment", default="tokens_choice_vit")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a core for others)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-growth", type=float, default=0.05, help="bound on the RSS growth, a fraction")
    parser.add_argument("--min-throughput-ratio", type=float, default=0.8)
    parser.add_argument("--table-rows", type=int, default=18)
    parser.add_argument("--json", type=Path, default=None, help="also write the records and verdict here")
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="keep data and outputs here (default: a temp dir)"
    )
    add_allocator_argument(parser)
    args = parser.parse_args(argv)
    for name in ("steps", "every", "steps_per_epoch", "batch_size", "embed_dim", "depth", "threads", "table_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup={args.warmup} must be in [0, --steps={args.steps})")
    # Records fall on the steps every --every from --every on; the verdict takes those at or after --warmup.
    first_record = max(1, -(-args.warmup // args.every)) * args.every
    if args.steps // args.every - first_record // args.every + 1 < 9:
        parser.error("the verdict needs at least 9 records after the warm-up: raise --steps or lower --every")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_allocator(args)
    torch.set_num_threads(args.threads)
    print(
        f"# soak: {args.steps} steps of {args.experiment} (embed_dim {args.embed_dim}, depth {args.depth}, batch "
        f"{args.batch_size}), torch {torch.__version__}, {args.threads} thread(s) of {os.cpu_count()} cores "
        f"({machine_info()['cpu']}), allocator {active_allocator()}"
    )
    if args.output_dir is not None:
        records = soak(args, args.output_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="moekit-soak-") as work_dir:
            records = soak(args, Path(work_dir))
    result = verdict(records, args.warmup, args.max_growth, args.min_throughput_ratio)
    print(_report(records, result, args))
    if args.json is not None:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "verdict": asdict(result)}
        payload["records"] = [asdict(r) for r in records]
        args.json.write_text(json.dumps(payload, indent=1))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
