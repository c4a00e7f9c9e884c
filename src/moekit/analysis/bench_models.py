"""Benchmark of whole models: the training-step time of each MoE model against its dense twin.

A benchmark, not a test: it prints tables of step times and of ratios measured in the same run. A
step is what ``scripts/train.py`` trains, built from the same Hydra configs: the task's
``training_step`` (forward, task loss + MoE auxiliary losses) under the trainer's precision
(``bf16-mixed``: bf16 autocast), backward, gradient clipping at ``trainer.gradient_clip_val``, a step of
the task's optimizer (``task.optimizer``, its parameter groups; no schedule), the loss-free balancing update
and ``zero_grad``, on a random batch of the data config's shapes and batch size. The optimizer runs at learning rate
0: its arithmetic in full, the parameters where they were. At the configured rate, without the schedule's warm-up, on
one batch over and over, the routers collapsed within a step or two (the top-2 MoE LM's layers would need 19-69% of
padding rows for equal groups at the first step, 56-188% from the second on; the top-2 ViT's 22% at the median over
the second half of a 240-step run on Fashion-MNIST), a state no training run passes through, and each round timed
another routing.
The models of a table are timed in interleaved rounds, so that a slow phase of the machine hits all of
them alike: in each round every model takes ``--warmup`` untimed steps, then ``--steps`` timed ones in a
row; its time is the median over all its timed steps. The warm-up step matters: a model's first step
after another model's runs slow (the five width-64 ViTs in turn, 4 rounds: Soft MoE +13 %, experts-choice
+6 % at the median, up to +30 % in the first round). The table
also shows the step's parameter update alone (clipping, optimizer step, balancing update, zero_grad),
which grows with a model's total parameters where the forward and backward grow with the active ones.

    python scripts/bench_models.py                          # both groups (ViTs at width 128, LMs)
    python scripts/bench_models.py --groups vit --override moe.num_experts=32
    python scripts/bench_models.py --device cuda            # adds achieved TFLOP/s and model FLOPs utilisation
    python scripts/bench_models.py --device cuda --groups s16 --profile   # S/16 vs ViT-S/16, where time goes
    python scripts/bench_models.py --groups vit --models soft_moe --sweep moe.slots_per_expert=1,2,4 \
        --override moe.capacity_factor=null
    python scripts/bench_models.py --groups scaling --sweep moe.num_experts=8,16,32,64,128,256
    python scripts/bench_models.py --groups main --sweep task.optimizer.name=adamw,muon   # the optimizers' step
    python scripts/bench_models.py --groups vit --vit-width 64 96 128 --json logs/bench_models/pareto.json
    python scripts/bench_models.py --quick                  # tiny shapes, a smoke run
    python scripts/bench_models.py --groups vit --choice ROW_BLOCK=128   # another kernel choice, as in bench_moe.py

Groups: ``vit`` - the Pareto sweep's models (``results=pareto``: each ``moe=`` recipe of the sweep), against
its ``moe=none`` twin; ``lm`` - the language sweep's models (``results=language``), ``mod_transformer_lm`` and
``lory_transformer_lm``, against ``dense_transformer_lm``; ``scaling`` - the expert-scaling sweep's routers
(``results=scaling``; not run by default), against its ``moe=none`` twin; ``main`` - the main job
(``experiment=soft_moe_vit``) against ``experiment=dense_vit`` (not run by default); ``s16`` - Soft MoE S/16
(``experiment=soft_moe_vit_s16_imagenet``: 224 px, batch 128, bf16) against ViT-S/16 (not run by default; a GPU's
table: a CPU takes seconds per step). ``--quick`` adds ``debug=tiny`` (the tiny model of each family).
The ``s16`` group's ImageNet folder is a stand-in of empty class folders: the benchmark reads only the config's shapes.
On ``--device cuda`` each table also shows the achieved TFLOP/s (3x the forward FLOPs per step: forward and
backward) and its share of the GPU's measured peak (one 8192^3 matmul in the step's precision): the model FLOPs
utilisation, MFU.
Parameters and forward FLOPs are those ``results.json`` records (:func:`moekit.models.summary.model_summary` /
``lm_summary``: FLOPs measured in eval mode). An ``--override`` whose key a model's config lacks
(``moe.num_experts`` for the dense twin) is left out for that model, and said so; one that no model of the group
has (a misspelt key) is refused. ``--models`` keeps some of a group's MoE models (the dense baseline always
runs); ``--sweep key=v1,v2`` times each kept MoE model once per value, in the same interleaved rounds (the step-time
side of an ablation, e.g. slots per expert), and the dense baseline once per value too where its config has the
key (``task.compile=false,true``: eager and compiled side by side; ``data.batch_size=128,512``: each MoE row
against the dense row of its own batch), else once.

``--json PATH`` also writes the tables as JSON, each row with its model's resolved config, batch size and
precision: ``scripts/plot_results.py --step-times PATH`` matches them to a sweep's runs and draws the
time axes from these step times, measured side by side, rather than from the runs' recorded times,
which drift with the machine between sessions.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from moekit.analysis.bench_model_options import check_overrides_applied, parse_sweep
from moekit.analysis.bench_model_tables import describe, print_table, table_record
from moekit.analysis.op_profile import print_top_operators
from moekit.analysis.peak import device_sync, matmul_peak
from moekit.analysis.step_times import STEP_TIMES_KIND
from moekit.commands.train import _summary
from moekit.configs import CONFIG_DIR, compose, instantiate
from moekit.models.summary import LMSummary, ModelSummary
from moekit.moe import kernel_choices, update_balancing_biases
from moekit.tasks import LanguageModel, MoETask
from moekit.tasks.optim import clip_grad_norm, optimizer_for
from moekit.tasks.precision import (
    AUTOCAST_DTYPES,
    autocast,
    forward_backward_seconds,
    no_trainer_warnings,
    random_batch,
)
from moekit.utils.allocator import active_allocator, add_allocator_argument, apply_allocator
from moekit.utils.atomic import write_json_atomic
from moekit.utils.machine import machine_info, resolve_precision

STAND_IN_ROOT = "stand-in-imagefolder"  # data.root of a group timed without its images (_stand_in_imagefolder)
GROUPS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    # group: (overrides of every model, {model: its overrides}; the first model is the dense baseline)
    "vit": (
        ["results=pareto"],
        {
            "dense": ["moe=none"],
            "soft_moe": ["moe=results/pareto_soft_moe"],
            "top1": ["moe=results/pareto_top1"],
            "top2": ["moe=results/pareto_top2"],
            "experts_choice": ["moe=results/pareto_experts_choice"],
        },
    ),
    "lm": (
        [],
        {
            "dense_transformer_lm": ["experiment=dense_transformer_lm"],
            "moe_transformer_lm": ["experiment=moe_transformer_lm"],
            "mod_transformer_lm": ["experiment=mod_transformer_lm"],
            "lory_transformer_lm": ["experiment=lory_transformer_lm"],
            "moe_lstm_lm_matched": ["experiment=results/moe_lstm_lm_matched"],
        },
    ),
    "main": ([], {"dense_vit": ["experiment=dense_vit"], "soft_moe_vit": ["experiment=soft_moe_vit"]}),
    "s16": (
        ["experiment=soft_moe_vit_s16_imagenet", f"data.root={STAND_IN_ROOT}"],
        {"vit_s16": ["moe=none"], "soft_moe_s16": []},
    ),
    "scaling": (
        ["results=scaling"],
        {
            "dense": ["moe=none"],
            "soft_moe": ["moe=results/scaling_soft_moe"],
            "top1": ["moe=results/scaling_top1"],
            "experts_choice": ["moe=results/scaling_experts_choice"],
        },
    ),
}
DEFAULT_GROUPS = ["vit", "lm"]
WIDTH_GROUPS = {"vit", "scaling"}  # the groups --vit-width applies to (model.embed_dim)

QUICK = ["debug=tiny"]  # the tiny model of each family (configs/debug/models/)
QUICK_BATCH = 8

_MISSING = object()
_SUPPORTED = {"bf16-mixed", "bf16", "32-true", "32"}  # the precisions a step is timed in


@dataclass
class Candidate:
    """One model ready to train: the task (its ``net``), the optimizer the run would build, a random
    batch on ``device``, the trainer's precision and clipping, and the model's summary; ``name`` is
    its row in the table, ``overrides`` what built it."""

    name: str
    overrides: list[str]
    cfg: DictConfig
    task: MoETask
    optimizer: torch.optim.Optimizer
    batch: tuple[Tensor, Tensor]
    precision: str
    clip_val: float | None
    summary: ModelSummary | LMSummary | None
    examples_per_step: int  # images, or tokens for a language model
    device: torch.device
    baseline: str = ""  # the dense row its "vs dense" divides by: the same swept value's, else the only one

    @property
    def unit(self) -> str:
        return "token" if isinstance(self.task, LanguageModel) else "image"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The matmuls' dtype: bf16 under ``bf16-mixed`` autocast, else float32."""
        return AUTOCAST_DTYPES.get(self.precision, torch.float32)

    @property
    def flops_per_example(self) -> float | None:
        if self.summary is None:
            return None
        return float(self.summary.flops_per_token if self.unit == "token" else self.summary.flops_per_image)


def compose_run(overrides: Sequence[str], config_dir: Path = CONFIG_DIR) -> DictConfig:
    """The config ``scripts/train.py <overrides>`` trains (nothing is written to its output folder)."""
    output_dir = Path(config_dir).parent / "logs" / "bench_models"
    return compose(config_dir, "train", [f"paths.root_dir={Path(config_dir).parent}", *overrides], output_dir)


def applicable_overrides(model: Sequence[str], overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``overrides`` into those that apply to the config of ``model`` (its overrides) and those whose
    key it lacks (``key=value`` of a missing key; ``+key``, ``++key``, ``~key`` and group choices always
    apply)."""
    if not overrides:
        return [], []
    cfg = compose_run(model)
    kept, dropped = [], []
    for override in overrides:
        key = override.split("=", 1)[0]
        if key.startswith(("+", "~")) or OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING:
            kept.append(override)
        else:
            dropped.append(override)
    return kept, dropped


def _precision(name: str, cfg: DictConfig, task: MoETask, batch: tuple[Tensor, Tensor]) -> str:
    """The trainer's precision for the row ``name``; ``auto`` as ``scripts/train.py`` resolves it (measured on
    ``task`` where the CPU's flags leave it open), and said so."""
    precision, why = resolve_precision(
        cfg.trainer.precision,
        cfg.trainer.get("accelerator", "auto"),
        measure=lambda: forward_backward_seconds(task, batch, ("32-true", "bf16-mixed")),
    )
    if why != "as configured":
        print(f"({name}: trainer.precision=auto: {precision}, {why})")
    if precision not in _SUPPORTED:
        raise ValueError(
            f"trainer.precision={precision!r} is not supported by this benchmark; use bf16-mixed or 32-true"
        )
    return precision


def _stand_in_imagefolder(num_classes: int) -> str:
    """A folder of ``train/`` and ``val/`` with ``num_classes`` empty class folders: what an ImageNet-style data
    config needs to build (the benchmark reads its shapes, never an image)."""
    root = Path(tempfile.mkdtemp(prefix="moekit-bench-imagefolder-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for split in ("train", "val"):
        for k in range(num_classes):
            (root / split / f"class_{k:05d}").mkdir(parents=True)
    return str(root)


def build_candidate(
    name: str, overrides: Sequence[str], batch_size: int | None = None, device: str | torch.device = "cpu"
) -> Candidate:
    """Build what ``scripts/train.py <overrides>`` would train: the task (seeded with the config's seed), its
    optimizer, and a random batch of the data config's batch size (or ``batch_size``)."""
    cfg = compose_run(overrides)
    if cfg.data.get("root") == STAND_IN_ROOT:
        cfg.data.root = _stand_in_imagefolder(cfg.data.num_classes)
    L.seed_everything(cfg.seed, verbose=False)
    datamodule = instantiate(cfg.data, _convert_="all")  # no data is read: the shapes only
    run_config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    task: MoETask = instantiate(cfg.task, net=cfg.model, run_config=run_config, _recursive_=False)
    summary = _summary(task, datamodule)  # measured on the CPU, as train() does before fit
    device = torch.device(device)
    task.to(device).train()
    batch = random_batch(task, datamodule, batch_size or datamodule.batch_size, device)
    precision = _precision(name, cfg, task, batch)
    # MoETask.configure_optimizers without the schedule (that needs a trainer for its length), at learning rate 0:
    # the step's cost, the routing of the initial weights at every step (the module docstring).
    optimizer = optimizer_for(task.net, task.optimizer_config, run_precision=precision)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    clip_val = cfg.trainer.get("gradient_clip_val")
    return Candidate(
        name=name,
        overrides=list(overrides),
        cfg=cfg,
        task=task,
        optimizer=optimizer,
        batch=batch,
        precision=precision,
        clip_val=float(clip_val) if clip_val else None,
        summary=summary,
        examples_per_step=batch[1].numel(),  # images, or target tokens
        device=device,
    )


@dataclass(frozen=True)
class StepTiming:
    """Seconds of a training step, and of its parameter update alone (gradient clipping, the optimizer
    step, the balancing update, ``zero_grad``: the part that grows with the total parameters, not the
    active ones)."""

    seconds: float
    update_seconds: float


def train_step(c: Candidate) -> tuple[StepTiming, Tensor]:
    """One training step of ``c`` as Lightning runs it; returns its timing and the loss it minimised."""
    device_sync(c.device)
    start = time.perf_counter()
    with autocast(c.precision, c.device), no_trainer_warnings():
        loss = c.task.training_step(c.batch, 0)
    loss.backward()
    device_sync(c.device)
    update_start = time.perf_counter()
    if c.clip_val:  # MoETask.configure_gradient_clipping: inside the fused step
        clip_grad_norm(c.optimizer, c.clip_val)
    c.optimizer.step()
    update_balancing_biases(c.task.net)  # MoETask.optimizer_step
    c.optimizer.zero_grad(set_to_none=True)
    device_sync(c.device)
    end = time.perf_counter()
    return StepTiming(seconds=end - start, update_seconds=end - update_start), loss.detach()


def time_models(candidates: list[Candidate], rounds: int, steps: int = 3, warmup: int = 1) -> dict[str, StepTiming]:
    """Each candidate's median step time (and median update time) over ``rounds x steps`` timed steps:
    in each round, every candidate in turn takes ``warmup`` untimed steps, then ``steps`` timed ones."""
    timings: dict[str, list[StepTiming]] = {c.name: [] for c in candidates}
    for _ in range(rounds):
        for c in candidates:
            for _ in range(warmup):
                train_step(c)
            timings[c.name].extend(train_step(c)[0] for _ in range(steps))
    return {
        name: StepTiming(
            seconds=statistics.median(t.seconds for t in ts),
            update_seconds=statistics.median(t.update_seconds for t in ts),
        )
        for name, ts in timings.items()
    }


def group_models(group: str, keep: Sequence[str] | None) -> list[str]:
    """The group's dense baseline followed by its MoE models (those named in ``keep``, if given)."""
    models = list(GROUPS[group][1])
    if not keep:
        return models
    unknown = [m for m in keep if m not in models[1:]]
    if unknown:
        raise SystemExit(f"--models {' '.join(unknown)}: not a MoE model of group {group!r}; choose from {models[1:]}")
    return [models[0], *[m for m in models[1:] if m in keep]]


def run_group(group: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time the group's models (one table per ViT width); print each table and return them as
    :func:`table_record` s."""
    shared, model_overrides = GROUPS[group]
    models = group_models(group, args.models)
    sweep = parse_sweep(args.sweep)
    base = [*shared, *(QUICK if args.quick else [])]
    widths = args.vit_width or ([] if args.quick else [128])
    variants = [[f"model.embed_dim={w}"] for w in widths] if group in WIDTH_GROUPS and widths else [[]]
    batch_size = args.batch_size or (QUICK_BATCH if args.quick else None)
    tables = []
    for variant in variants:
        candidates, applied, dense = [], [], {}  # dense: swept value (None: not swept) -> the dense row's name
        for i, model in enumerate(models):
            overrides = [*base, *model_overrides[model], *variant]
            kept, dropped = applicable_overrides(overrides, list(args.override))
            applied += kept
            if dropped:
                print(f"({model}: {' '.join(dropped)} left out, no such key in its config)")
            # A model runs once where its config lacks the swept key (dense and moe.*, top-1 and slots), else per value.
            per_value = sweep and applicable_overrides(overrides, [f"{sweep[0]}={sweep[1][0]}"])[0]
            if sweep and not per_value and i > 0:
                print(f"({model}: no {sweep[0]} in its config, timed once)")
            settings = sweep[1] if per_value else [None]
            for value in settings:
                swept = [] if value is None else [f"{sweep[0]}={value}"]
                name = model if value is None else f"{model} {sweep[0].rsplit('.', 1)[-1]}={value}"
                if i == 0:
                    dense[value] = name
                size = None if swept and sweep[0] == "data.batch_size" else batch_size  # the swept size, not --quick's
                candidate = build_candidate(name, [*overrides, *kept, *swept], size, args.device)
                candidate.baseline = dense.get(value) or dense.get(None) or next(iter(dense.values()))
                candidates.append(candidate)
        check_overrides_applied(group, args.override, applied)
        times = time_models(candidates, args.rounds, args.steps, args.warmup)
        what = f", width {variant[0].split('=')[1]}" if variant else ""
        extras = f", overrides: {' '.join(args.override)}" if args.override else ""
        setup = " ".join(base) or "experiments"
        title = f"{group}: {setup}{what}, {describe(candidates)}{extras}"
        print_table(title, candidates, times, peak=args.peak)
        for c in candidates if args.profile else []:
            print_top_operators(f"{c.name}, one training step", lambda c=c: train_step(c), c.device)
        tables.append(table_record(title, candidates, times, peak=args.peak))
        del candidates
        gc.collect()
    return tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=DEFAULT_GROUPS)
    parser.add_argument("--models", nargs="+", help="MoE models of the group to time (default: all)")
    parser.add_argument(
        "--sweep", help="key=v1,v2,...: time each model whose config has the key once per value, in the same rounds"
    )
    parser.add_argument("--vit-width", type=int, nargs="+", help="model.embed_dim of the ViTs, one table each")
    parser.add_argument("--batch-size", type=int, help="default: the data config's batch size")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per table (median reported)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps in a row per model and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model before its timed ones")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of the script")
    parser.add_argument("--profile", action="store_true", help="after each table: where each model's step goes")
    parser.add_argument("--json", type=Path, help="also write the tables here (for plot_results.py --step-times)")
    parser.add_argument(
        "--override", nargs="+", default=[], help="Hydra overrides for every model (e.g. moe.num_experts=32)"
    )
    add_allocator_argument(parser)
    kernel_choices.add_choice_argument(parser)
    args = parser.parse_args(argv)
    apply_allocator(args)
    kernel_choices.apply_choice_argument(parser, args)
    for name in ("rounds", "steps", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={value} must be positive")
    if args.warmup < 0:
        raise SystemExit(f"--warmup={args.warmup} must be 0 or more")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # fail now, not after the timing
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    gpu = f", GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    machine = machine_info()
    dtypes = (torch.bfloat16, torch.float32)  # every Candidate.compute_dtype
    args.peak = {dtype: matmul_peak("cuda", dtype)[0] for dtype in dtypes} if args.device == "cuda" else None
    print(
        f"# moekit model benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{machine['cpu']} x{machine['cpu_cores']}{gpu}, allocator: {active_allocator()}, "
        f"OpenMP {machine['openmp_spin']}, float32 CPU products: {machine['cpu_float32_matmul']['library']}, "
        f"kernel choices: {kernel_choices.describe()}; one training step (forward, "
        f"backward, clip, optimizer step), median of {args.rounds} interleaved rounds x {args.steps} steps after "
        f"{args.warmup} warm-up step(s) each"
    )
    if args.peak:
        print(
            f"# MFU: achieved FLOP/s over the measured peak, {args.peak[torch.bfloat16] / 1e12:.0f} TFLOP/s bf16 and "
            f"{args.peak[torch.float32] / 1e12:.0f} TFLOP/s float32 (one 8192^3 matmul, best of 3)"
        )
    tables = [table for group in args.groups for table in run_group(group, args)]
    if args.json:
        record = {
            "kind": STEP_TIMES_KIND,
            "version": 1,
            "argv": sys.argv[1:] if argv is None else list(argv),
            "device": args.device,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "allocator": active_allocator(),
            "kernel_choices": kernel_choices.changes(),
            "machine": machine,
            "tables": tables,
        }
        print(f"wrote {write_json_atomic(args.json, record)}")


if __name__ == "__main__":
    main()
