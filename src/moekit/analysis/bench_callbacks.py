"""Overhead of the expert-load monitor: a training step of the main job with and without it.

The main job is ``experiment=soft_moe_vit`` (its model, optimizer and schedule; batch 256, the experiment's precision:
``auto``, bf16 autocast on AMX CPUs and float32 elsewhere, unmeasured here; the header says which), trained by
Lightning on random 28 x 28 images with a TensorBoard logger. The two arms - the default callbacks'
``ThroughputMonitor`` alone, and with :class:`~moekit.callbacks.ExpertLoadMonitor` (logging every 50 steps) - are
fitted in alternating rounds from the same initial weights, so a slow phase of the machine hits both alike. A step is
timed from ``on_train_batch_start`` to the end of every callback's ``on_train_batch_end``
(forward, backward, optimizer step, the monitor's accumulation and, every 50 steps, its logging),
the first ``--warmup`` steps of each fit left out. The script prints the mean and median step
times of each arm and their ratio, measured in this one run.

    python scripts/bench_callbacks.py                        # 2 rounds x 100 steps per arm (~3 min, 2 cores)
    python scripts/bench_callbacks.py --steps 10 --rounds 1  # a smoke run
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from moekit.callbacks import ExpertLoadMonitor, ThroughputMonitor
from moekit.configs import CONFIG_DIR, compose, instantiate
from moekit.utils.allocator import active_allocator, add_allocator_argument, apply_allocator
from moekit.utils.machine import resolve_precision


class StepTimer(Callback):
    """Wall time of each training step; placed last so that every other callback's
    ``on_train_batch_end`` is inside the timed span."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def _main_job_config(batch_size: int, output_dir: Path):
    return compose(CONFIG_DIR, "train", ["experiment=soft_moe_vit", f"data.batch_size={batch_size}"], output_dir)


def _fit(cfg, loader: DataLoader, steps: int, warmup: int, monitor: bool, log_dir: Path, seed: int) -> list[float]:
    L.seed_everything(seed, verbose=False)
    module = instantiate(cfg.task, net=cfg.model, _recursive_=False)
    timer = StepTimer(warmup)
    callbacks: list[Callback] = [ThroughputMonitor(unit="images")]
    if monitor:
        callbacks.append(ExpertLoadMonitor(log_every_n_steps=50))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        precision=resolve_precision(cfg.trainer.precision, "cpu")[0],
        max_steps=warmup + steps,
        log_every_n_steps=50,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        logger=TensorBoardLogger(str(log_dir), name="monitor" if monitor else "plain"),
        callbacks=[*callbacks, timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    return timer.times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per fit (the monitor logs every 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each fit")
    parser.add_argument("--rounds", type=int, default=2, help="fits per arm, alternating")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    add_allocator_argument(parser)
    args = parser.parse_args(argv)
    apply_allocator(args)
    for name in ("steps", "warmup", "rounds", "batch_size"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")

    log_dir = Path(tempfile.mkdtemp(prefix="moekit-bench-callbacks-"))
    cfg = _main_job_config(args.batch_size, log_dir)
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(32 * args.batch_size, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (images.shape[0],), generator=generator)
    loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch_size, shuffle=True, drop_last=True)
    print(
        f"# expert-load monitor overhead: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"allocator {active_allocator()}; {OmegaConf.select(cfg, 'model.model_name')} (soft_moe_vit), "
        f"batch {args.batch_size}, {resolve_precision(cfg.trainer.precision, 'cpu')[0]}, "
        f"{args.steps} timed steps x {args.rounds} rounds per arm"
    )
    times: dict[str, list[float]] = {"without": [], "with": []}
    try:
        for _ in range(args.rounds):
            for arm in times:
                times[arm] += _fit(cfg, loader, args.steps, args.warmup, arm == "with", log_dir, args.seed)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    mean = {arm: statistics.fmean(ts) for arm, ts in times.items()}
    median = {arm: statistics.median(ts) for arm, ts in times.items()}
    print("\n| arm | mean step ms | median step ms |\n|---|---:|---:|")
    for arm in times:
        print(f"| {arm} monitor | {mean[arm] * 1e3:.1f} | {median[arm] * 1e3:.1f} |")
    print(
        f"\nstep time with / without the monitor: {mean['with'] / mean['without']:.4f} (means), "
        f"{median['with'] / median['without']:.4f} (medians)"
    )


if __name__ == "__main__":
    main()
