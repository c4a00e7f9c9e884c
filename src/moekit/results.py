"""Run records (``results.json``) and what turns a sweep's records into tables and figures.

Every :func:`moekit.run.train` writes ``<paths.output_dir>/results.json`` (:func:`build_run_record`);
``scripts/plot_results.py <folder>`` reads every record under a folder (:func:`load_results`), groups
the runs that differ only in their seed (:func:`group_results`), and draws the figure of each results
sweep (``configs/experiment/results/``) with the mean over seeds and the min-max range as error bars
(:func:`plot_pareto`, :func:`plot_scaling`, :func:`plot_language`, :func:`plot_ablations`), plus a
markdown table (:func:`markdown_table`).

Wall times recorded by runs of different sessions (or beside other work) are not comparable: the
machine's speed drifts. ``scripts/bench_models.py --json`` times the models' training steps in one
interleaved run; :func:`load_step_times` reads its file and :func:`attach_step_times` gives each run
the step time of its model (matched by :func:`step_time_key`: the resolved model config, the batch size
and the precision), which the figures then use in place of the recorded times.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moekit.moe import moe_layers

__all__ = [
    "RESULTS_FILE",
    "RunResult",
    "Stat",
    "Group",
    "machine_info",
    "machine_label",
    "model_family",
    "build_run_record",
    "write_json_atomic",
    "load_results",
    "archive_records",
    "StepTime",
    "step_time_key",
    "load_step_times",
    "attach_step_times",
    "summarize",
    "group_results",
    "figure_kind",
    "markdown_table",
    "merge_markdown_tables",
    "plot_pareto",
    "plot_scaling",
    "plot_language",
    "plot_ablations",
    "plot_all",
]

RESULTS_FILE = "results.json"
RECORD_VERSION = 1
"""Bumped when a field of the record changes meaning."""


# ---------------------------------------------------------------------------------------------
# Writing a run record


def _cpu_model() -> str:
    """The CPU's marketing name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What a run ran on: CPU model, logical cores (all, and those this process may use), torch
    threads, torch / Python versions, the OS, and the GPU's name (None without CUDA)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def machine_label(machine: Mapping[str, Any]) -> str:
    """``"AMD EPYC, 1 torch thread"`` (``, NVIDIA H100 x1`` with a GPU) from :func:`machine_info`'s dict:
    what decides a run's speed, and its float rounding (one machine and thread count repeats a seeded
    run bit for bit; another gives another draw)."""
    threads = machine.get("torch_threads")
    label = f"{machine.get('cpu', 'unknown CPU')}, {threads} torch thread{'s' if threads != 1 else ''}"
    if machine.get("gpu"):
        label += f", {machine['gpu']} x{machine.get('gpu_count', 1)}"
    return label


def _git_commit(directory: Path) -> str | None:
    """The commit checked out in ``directory`` (None outside a git checkout); ``+dirty`` when files differ."""
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()

        commit = git("rev-parse", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


_LAYER_SETTINGS = (
    "top_k",
    "slots_per_expert",
    "capacity_factor",
    "eval_capacity_factor",
    "batch_priority",
    "normalize",
)


def _moe_layer_settings(net: nn.Module) -> list[dict[str, Any]]:
    """Per MoE layer of ``net``: its name, registry type, experts, and the routing settings it has
    (top-k, slots per expert, capacity factors, BPR, Soft MoE's l2 normalisation)."""
    layers = []
    for name, layer in moe_layers(net):
        entry: dict[str, Any] = {
            "name": name,
            "layer": getattr(layer, "registry_name", type(layer).__name__),
            "num_experts": layer.experts.num_experts,
        }
        entry.update({key: getattr(layer, key) for key in _LAYER_SETTINGS if hasattr(layer, key)})
        layers.append(entry)
    return layers


def model_family(net: nn.Module) -> str:
    """A short name for the kind of network, for grouping runs: the router of its MoE layers
    (``dense``, ``soft_moe``, ``top1``, ``top2``, ``experts_choice``, ...), prefixed with
    ``transformer/`` or ``lstm/`` for language models."""
    routers = []
    for _, layer in moe_layers(net):
        name = getattr(layer, "registry_name", type(layer).__name__)
        top_k = getattr(layer, "top_k", None)
        routers.append(f"top{top_k}" if name == "top_k" and top_k is not None else name)
    router = "+".join(dict.fromkeys(routers)) or "dense"
    arch = type(net).__name__
    if arch == "TransformerLM":
        return f"transformer/{router}"
    if arch == "LSTMMoELM":
        return f"lstm/{router}"
    return router


def _split_metrics(metrics: Mapping[str, float], split: str) -> dict[str, float]:
    """``{"acc": ...}`` from ``{"<split>/acc": ...}`` (aux losses and other nested names included)."""
    prefix = f"{split}/"
    return {k.removeprefix(prefix): float(v) for k, v in metrics.items() if k.startswith(prefix)}


def build_run_record(
    *,
    run_config: Mapping[str, Any],
    overrides: Sequence[str],
    net: nn.Module,
    summary: Any,
    counter: Any,
    metrics: Mapping[str, float],
    trainer: Any,
) -> dict[str, Any]:
    """The content of ``results.json`` for one run of :func:`moekit.run.train`.

    Args:
        run_config: the resolved run config (everything but ``hydra``).
        overrides: the command-line / sweep overrides of the run (``hydra.overrides.task``).
        net: the trained network.
        summary: its :class:`~moekit.models.summary.ModelSummary` (images) or
            :class:`~moekit.models.summary.LMSummary` (tokens); None when it could not be measured.
        counter: the run's :class:`~moekit.callbacks.TrainingCounter`.
        metrics: what :func:`~moekit.run.train` returns (``val/*`` after fit, ``test/*`` after test).
        trainer: the Lightning trainer (steps, world size, the best checkpoint's score).
    """
    per_token = summary is not None and hasattr(summary, "flops_per_token")
    forward = None if summary is None else float(summary.flops_per_token if per_token else summary.flops_per_image)
    # Training FLOPs: forward + backward ~ 3 x the forward (the backward pass costs about twice the forward:
    # gradients with respect to activations and to weights), times the examples trained on. An estimate:
    # routers, auxiliary losses, the optimizer and recomputation are not counted separately.
    training = None if forward is None else 3.0 * forward * counter.examples
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    best_score = getattr(checkpoint, "best_model_score", None)
    model_cfg = run_config.get("model", {})
    layers = _moe_layer_settings(net)
    return {
        "version": RECORD_VERSION,
        "task_name": run_config.get("task_name"),
        "tags": list(run_config.get("tags") or []),
        "seed": run_config.get("seed"),
        "overrides": list(overrides),
        "model": {
            "name": model_cfg.get("model_name") or str(model_cfg.get("_target_", type(net).__name__)).rsplit(".")[-1],
            "family": model_family(net),
            "num_experts": max((layer["num_experts"] for layer in layers), default=0),
            "moe_layers": layers,
        },
        "params": {
            "total": None if summary is None else int(summary.total_params),
            "active_per_token": None if summary is None else float(summary.active_params_per_token),
        },
        "flops": {
            "example": "token" if per_token else "image",
            "forward_per_example": forward,
            "training": training,
        },
        "training": {
            "examples_seen": counter.examples,
            "batches": counter.batches,
            "optimizer_steps": int(getattr(trainer, "global_step", 0)),
            "world_size": int(getattr(trainer, "world_size", 1)),
            "fit_seconds": counter.fit_seconds,
            "mean_batch_seconds": counter.mean_batch_seconds,
            "mean_throughput": counter.mean_throughput,
            "throughput_unit": f"{'tokens' if per_token else 'images'}/s",
            "resumed_from": run_config.get("ckpt_path"),
        },
        "metrics": {
            "val": _split_metrics(metrics, "val"),
            "test": _split_metrics(metrics, "test"),
            "best_val": None
            if best_score is None
            else {"monitor": checkpoint.monitor, "value": float(best_score), "checkpoint": checkpoint.best_model_path},
        },
        "machine": machine_info(),
        "git_commit": _git_commit(Path(__file__).resolve().parent),
        "config": dict(run_config),
    }


def write_json_atomic(path: str | os.PathLike, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same folder, fsync-ed and
    renamed over ``path``: a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str, allow_nan=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# Reading and aggregating records


def _parse_override(override: str) -> tuple[str, str]:
    """``("model.embed_dim", "64")`` from ``"model.embed_dim=64"`` (also ``+key=`` / ``++key=``)."""
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


@dataclass(frozen=True)
class RunResult:
    """One run, read from its ``results.json``.

    Attributes:
        path: the run's folder.
        task_name: the experiment's ``task_name`` (``results_pareto``, ...).
        family: :func:`model_family` of its network.
        seed: the run's seed.
        setting: its overrides but the seed, as sorted ``(key, value)`` pairs: runs with the same
            ``task_name`` and setting are seeds of one configuration.
        num_experts: the most experts of any MoE layer (0 for a dense network).
        total_params, active_params: parameters in all, and used per token.
        forward_flops: forward FLOPs per example (image or token).
        training_flops: 3 x ``forward_flops`` x the examples trained on.
        fit_seconds: wall time of training (validation included).
        batch_seconds: mean time of a training batch (data loading included).
        throughput: mean training examples per second.
        examples_seen: training examples (images or tokens) of the run.
        step_key: :func:`step_time_key` of its model, batch size and precision (None for a record
            without its config).
        bench_step_seconds, bench_examples_per_step: the benchmarked step time of its model and the
            examples of that step (:func:`attach_step_times`), or None.
        val, test: the final validation metrics and the test metrics (``acc``, ``acc_top5`` or
            ``ppl``, ``bpb``, ...).
        machine: what it ran on (:func:`machine_label`), None for a record without it.
    """

    path: Path
    task_name: str
    family: str
    seed: int | None
    setting: tuple[tuple[str, str], ...]
    num_experts: int
    total_params: int | None
    active_params: float | None
    forward_flops: float | None
    training_flops: float | None
    fit_seconds: float | None
    batch_seconds: float | None
    throughput: float | None
    examples_seen: int | None
    step_key: str | None
    val: Mapping[str, float]
    test: Mapping[str, float]
    bench_step_seconds: float | None = None
    bench_examples_per_step: int | None = None
    machine: str | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any], path: Path) -> RunResult:
        """Read the fields of a ``results.json`` record (:func:`build_run_record`)."""
        pairs = (_parse_override(o) for o in record.get("overrides", []))
        training = record.get("training", {})
        config = record.get("config") or {}
        step_key = None
        if {"model", "data", "trainer"} <= set(config) and "batch_size" in config["data"]:
            step_key = step_time_key(config["model"], config["data"]["batch_size"], config["trainer"]["precision"])
        return cls(
            path=path,
            task_name=str(record.get("task_name")),
            family=record["model"]["family"],
            seed=record.get("seed"),
            setting=tuple(sorted((k, v) for k, v in pairs if k != "seed")),
            num_experts=int(record["model"].get("num_experts", 0)),
            total_params=record["params"].get("total"),
            active_params=record["params"].get("active_per_token"),
            forward_flops=record["flops"].get("forward_per_example"),
            training_flops=record["flops"].get("training"),
            fit_seconds=training.get("fit_seconds"),
            batch_seconds=training.get("mean_batch_seconds"),
            throughput=training.get("mean_throughput"),
            examples_seen=training.get("examples_seen"),
            step_key=step_key,
            machine=machine_label(record["machine"]) if record.get("machine") else None,
            val=dict(record["metrics"].get("val", {})),
            test=dict(record["metrics"].get("test", {})),
        )

    @property
    def bench_seconds(self) -> float | None:
        """The run's training time at its benchmarked step time: steps x ``bench_step_seconds`` (None
        without a step time)."""
        if self.bench_step_seconds is None or not self.bench_examples_per_step or self.examples_seen is None:
            return None
        return self.bench_step_seconds * self.examples_seen / self.bench_examples_per_step


def load_results(folder: str | os.PathLike) -> list[RunResult]:
    """Every ``results.json`` under ``folder`` (any depth), sorted by path.

    Raises:
        FileNotFoundError: ``folder`` does not exist or holds no ``results.json``.
        ValueError: a file is not a readable run record (the message names it).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder; give the sweep folder, e.g. logs/results/pareto")
    files = sorted(folder.rglob(RESULTS_FILE))
    if not files:
        raise FileNotFoundError(
            f"no {RESULTS_FILE} under {str(folder)!r}: every finished run of scripts/train.py writes one in its "
            "output folder; run a sweep first (python scripts/train.py -m experiment=results/pareto) or give "
            "the folder it wrote (logs/results/pareto)"
        )
    results = []
    for file in files:
        try:
            results.append(RunResult.from_record(json.loads(file.read_text()), file.parent))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{str(file)!r} is not a moekit run record ({type(err).__name__}: {err})") from None
    return results


def archive_records(source: str | os.PathLike, dest: str | os.PathLike, *, replace: bool = False) -> list[Path]:
    """Copy the record of every run under ``source`` to the same relative folder under ``dest``.

    A sweep folder holds each run's checkpoints and TensorBoard events (megabytes) beside its
    ``results.json`` (kilobytes); ``dest`` gets the records alone, so it can be committed with the
    figures and :func:`load_results` / ``scripts/plot_results.py`` read it like the sweep folder.
    ``logs/`` is not kept across machines: a figure whose records are only there cannot be redrawn
    (or extended by another seed) later.

    Args:
        source: a sweep folder or ``logs/results``.
        dest: the archive (``docs/figures/results/runs``).
        replace: overwrite a record in ``dest`` that differs from the one in ``source`` (a rerun of
            the same setting and seed); without it such a record is an error and nothing is written.

    Returns:
        The records written to ``dest`` (records already there and identical are left alone).

    Raises:
        FileNotFoundError: ``source`` holds no record.
        ValueError: a record is unreadable, or differs from the one archived and ``replace`` is false.
    """
    source, dest = Path(source), Path(dest)
    load_results(source)  # every record is readable, or the error names the one that is not
    pending = []
    for file in sorted(source.rglob(RESULTS_FILE)):
        if dest.resolve() in file.resolve().parents:
            continue  # the archive itself lies under source
        record = json.loads(file.read_text())
        target = dest / file.relative_to(source)
        if target.exists():
            if json.loads(target.read_text()) == record:
                continue
            if not replace:
                raise ValueError(
                    f"{str(file)!r} differs from the record archived for its setting and seed, {str(target)!r} "
                    "(a rerun); pass replace=True (archive_runs.py --replace) to keep the new one, or archive to "
                    "another folder"
                )
        pending.append((target, record))
    for target, record in pending:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(target, record)
    return [target for target, _ in pending]


# ---------------------------------------------------------------------------------------------
# Step times from scripts/bench_models.py --json

STEP_TIMES_KIND = "moekit.bench_models"


def step_time_key(model_config: Mapping[str, Any], batch_size: int, precision: str) -> str:
    """What makes two training steps the same work: the resolved model config, the batch size (images
    or sequences) and the trainer's precision, as one canonical string."""
    return json.dumps(
        {"model": model_config, "batch_size": int(batch_size), "precision": str(precision)}, sort_keys=True
    )


@dataclass(frozen=True)
class StepTime:
    """One model's benchmarked training step.

    Attributes:
        name: the benchmark's row (``soft_moe_vit``, ``soft_moe_vit num_experts=32``, ...).
        seconds: the median seconds of a training step.
        examples_per_step: images (or tokens) in the step's batch.
        source: the file it was read from.
    """

    name: str
    seconds: float
    examples_per_step: int
    source: Path


def load_step_times(paths: Iterable[str | os.PathLike]) -> dict[str, StepTime]:
    """The step times of ``scripts/bench_models.py --json`` files, by :func:`step_time_key`.

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: a file is not such a benchmark file, or two rows time the same model (the message
            names both: give each model's step time once).
    """
    times: dict[str, StepTime] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(path)!r} does not exist; write one with python scripts/bench_models.py --json {path}"
            )
        try:
            data = json.loads(path.read_text())
            if data.get("kind") != STEP_TIMES_KIND:
                raise ValueError(f"its kind is {data.get('kind')!r}, not {STEP_TIMES_KIND!r}")
            entries = [
                (
                    step_time_key(row["model_config"], row["batch_size"], row["precision"]),
                    StepTime(row["name"], float(row["seconds_per_step"]), int(row["examples_per_step"]), path),
                )
                for table in data["tables"]
                for row in table["rows"]
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"{str(path)!r} is not a step-time file of scripts/bench_models.py --json ({type(err).__name__}: {err})"
            ) from None
        for key, step in entries:
            if key in times:
                first = times[key]
                raise ValueError(
                    f"the model of {step.name!r} ({path}) is timed twice: also {first.name!r} ({first.source}); "
                    "give each model's step time once"
                )
            times[key] = step
    return times


def attach_step_times(results: Sequence[RunResult], step_times: Mapping[str, StepTime]) -> list[RunResult]:
    """``results`` with ``bench_step_seconds`` set from the step time of each run's model, where the
    step times have one (:attr:`RunResult.step_key`); the other runs are returned unchanged."""
    attached = []
    for run in results:
        step = step_times.get(run.step_key)
        if step is not None:
            run = replace(run, bench_step_seconds=step.seconds, bench_examples_per_step=step.examples_per_step)
        attached.append(run)
    return attached


@dataclass(frozen=True)
class Stat:
    """Mean, median and spread of one quantity over the seeds of a configuration.

    Metrics are shown at their mean, times at their median (:meth:`center`).

    Attributes:
        mean, median: the mean and the median; low, high: the smallest and the largest value (the error
        bars); std: the sample standard deviation (0 for one value); n: the number of values.
    """

    mean: float
    median: float
    low: float
    high: float
    std: float
    n: int

    def center(self, median: bool = False) -> float:
        """The median or the mean. Times use the median: a run slowed by other work on the machine
        moves the mean of its seeds, not their median."""
        return self.median if median else self.mean


def summarize(values: Iterable[float | None]) -> Stat | None:
    """:class:`Stat` of the values that are not None (None when none is)."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    n = len(present)
    mean = sum(present) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in present) / (n - 1)) if n > 1 else 0.0
    return Stat(mean=mean, median=statistics.median(present), low=min(present), high=max(present), std=std, n=n)


@dataclass(frozen=True)
class Group:
    """The runs (seeds) of one configuration: the same ``task_name``, family and setting."""

    task_name: str
    family: str
    setting: tuple[tuple[str, str], ...]
    runs: tuple[RunResult, ...]

    def stat(self, value: Callable[[RunResult], float | None]) -> Stat | None:
        """:class:`Stat` of ``value(run)`` over the runs."""
        return summarize(value(run) for run in self.runs)

    @property
    def seeds(self) -> list[int | None]:
        return sorted((run.seed for run in self.runs), key=lambda s: (s is None, s))


def group_results(results: Iterable[RunResult]) -> list[Group]:
    """One :class:`Group` per configuration, in order of task, family and setting (numbers in a
    setting by value: 8 experts before 16, width 64 before 128)."""
    buckets: dict[tuple, list[RunResult]] = {}
    for run in results:
        buckets.setdefault((run.task_name, run.family, run.setting), []).append(run)
    return [Group(*key, runs=tuple(runs)) for key, runs in sorted(buckets.items(), key=lambda item: _order(item[0]))]


def _order(key: tuple[str, str, tuple[tuple[str, str], ...]]) -> tuple:
    """The sort key of a (task, family, setting) triple: numeric values compare as numbers, before words."""
    task, family, setting = key

    def value(text: str) -> tuple[int, float, str]:
        try:
            return (0, float(text), "")
        except ValueError:
            return (1, 0.0, text)

    return task, family, tuple((name, value(text)) for name, text in setting)


def setting_label(group: Group, groups: Sequence[Group]) -> str:
    """``group``'s overrides whose values differ between the groups of its task (``"model=dense_vit,
    model.embed_dim=64"``); a ``results/`` model config shows without the folder."""
    same_task = [g for g in groups if g.task_name == group.task_name]
    varying = {k for g in same_task for k, v in g.setting if any(dict(h.setting).get(k) != v for h in same_task)}
    parts = [f"{k}={v.removeprefix('results/')}" for k, v in group.setting if k in varying]
    return ",".join(parts) or "-"


def figure_kind(task_name: str) -> str | None:
    """Which figure a results sweep gets: ``pareto``, ``scaling``, ``language``, ``ablations``
    (``results_ablation_*``), or None for runs of other experiments (table only)."""
    if task_name.startswith("results_ablation"):
        return "ablations"
    kind = task_name.removeprefix("results_")
    return kind if task_name.startswith("results_") and kind in ("pareto", "scaling", "language") else None


# ---------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class _Metric:
    """A test metric as shown: its key in ``RunResult.test``, its label, and a display scale."""

    key: str
    label: str
    scale: float = 1.0


_IMAGE_METRICS = (_Metric("acc", "test top-1 %", 100.0), _Metric("acc_top5", "test top-5 %", 100.0))
_LM_METRICS = (_Metric("ppl", "test ppl"), _Metric("bpb", "test bits/byte"))


def _metrics_of(runs: Iterable[RunResult]) -> tuple[_Metric, ...]:
    """The test metrics to show: accuracy for image classifiers, perplexity for language models."""
    return _IMAGE_METRICS if any("acc" in run.test for run in runs) else _LM_METRICS


def _si(value: float | None) -> str:
    """``1.22M``-style number (``-`` for None)."""
    if value is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.3g}"


def _spread(stat: Stat | None, scale: float = 1.0, digits: int = 2, median: bool = False) -> str:
    """``mean (min-max)`` (``median (min-max)`` for times), or the value alone for one run."""
    if stat is None:
        return "-"
    value = f"{stat.center(median) * scale:.{digits}f}"
    return value if stat.n == 1 else f"{value} ({stat.low * scale:.{digits}f}-{stat.high * scale:.{digits}f})"


def _task_table(groups: Sequence[Group]) -> list[str]:
    metrics = _metrics_of(run for g in groups for run in g.runs)
    header = ["setting", "family", "seeds", "params", "active params / token", "FLOPs / example", "training FLOPs"]
    benched = any(run.bench_step_seconds is not None for g in groups for run in g.runs)
    header += ["fit time s", "step ms", *(["bench step ms"] if benched else []), *(m.label for m in metrics)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group in groups:
        cells = [
            f"`{setting_label(group, groups)}`",
            group.family,
            ",".join(str(s) for s in group.seeds),
            _si(_mean(group.stat(lambda r: r.total_params))),
            _si(_mean(group.stat(lambda r: r.active_params))),
            _si(_mean(group.stat(lambda r: r.forward_flops))),
            _si(_mean(group.stat(lambda r: r.training_flops))),
            _spread(group.stat(lambda r: r.fit_seconds), digits=0, median=True),
            _spread(group.stat(lambda r: r.batch_seconds), scale=1e3, digits=0, median=True),
        ]
        if benched:
            cells.append(_spread(group.stat(lambda r: r.bench_step_seconds), scale=1e3, digits=0, median=True))
        cells += [_spread(group.stat(lambda r, key=m.key: r.test.get(key)), scale=m.scale) for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _mean(stat: Stat | None) -> float | None:
    return None if stat is None else stat.mean


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y against x through ``(x, y)`` points (at least two distinct x)."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def _scaling_trends(groups: Sequence[Group]) -> list[str]:
    """The reading of a scaling sweep, per router: the slope of the test metric against log2(experts)
    fitted to each seed's runs, and each run's difference to the dense run of the same seed (paired:
    the runs of one seed hold out the same validation images and train on the same batches)."""
    metric = _metrics_of(run for g in groups for run in g.runs)[0]
    runs = [run for g in groups for run in g.runs if run.test.get(metric.key) is not None]
    dense = {run.seed: run.test[metric.key] for run in runs if run.num_experts == 0}
    lines = [
        f"| router | seeds | {metric.label} per doubling of experts: mean (per seed) | vs dense of the same seed: mean "
        "(min to max) | above dense |",
        "|---|---|---|---|---|",
    ]
    for family in dict.fromkeys(run.family for run in runs if run.num_experts > 0):
        mine = [run for run in runs if run.family == family]
        seeds = sorted({run.seed for run in mine}, key=lambda s: (s is None, s))
        slopes = []
        for seed in seeds:
            points = [(math.log2(r.num_experts), r.test[metric.key] * metric.scale) for r in mine if r.seed == seed]
            if len({x for x, _ in points}) > 1:
                slopes.append(_slope(points))
        diffs = [(r.test[metric.key] - dense[r.seed]) * metric.scale for r in mine if r.seed in dense]
        slope = f"{sum(slopes) / len(slopes):+.2f} ({', '.join(f'{s:+.2f}' for s in slopes)})" if slopes else "-"
        paired = f"{sum(diffs) / len(diffs):+.2f} ({min(diffs):+.2f} to {max(diffs):+.2f})" if diffs else "-"
        above = f"{sum(d > 0 for d in diffs)} of {len(diffs)}" if diffs else "-"
        lines.append(f"| {family} | {','.join(map(str, seeds))} | {slope} | {paired} | {above} |")
    return lines


def _median_ratio(pairs: Sequence[tuple[RunResult, RunResult]], value: Callable[[RunResult], float | None]) -> str:
    """``0.95x``: the median over ``(run, reference)`` pairs of ``value(run) / value(reference)``."""
    ratios = [value(r) / value(d) for r, d in pairs if value(r) is not None and value(d)]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def _pareto_pairs(groups: Sequence[Group]) -> list[str]:
    """The reading of a Pareto sweep: each MoE configuration against the dense run of the same setting
    but the model (its width) and the same seed (paired: one seed's runs see the same batches). FLOPs
    and fit time as ratios to that dense run (the median over the seeds), the test metric as
    differences, seed by seed."""
    metric = _metrics_of(run for g in groups for run in g.runs)[0]

    def without_model(group: Group) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in group.setting if k != "model")

    dense = {(without_model(g), run.seed): run for g in groups if g.family == "dense" for run in g.runs}
    lines = [
        f"| setting | seeds | FLOPs / example vs dense | fit time vs dense | {metric.label} vs dense: mean (per seed) "
        "| above dense |",
        "|---|---|---|---|---|---|",
    ]
    for group in groups:
        pairs = [(run, dense.get((without_model(group), run.seed))) for run in group.runs]
        pairs = sorted(((r, d) for r, d in pairs if d is not None), key=lambda p: (p[0].seed is None, p[0].seed))
        if group.family == "dense" or not pairs:
            continue
        diffs = [
            (r.test[metric.key] - d.test[metric.key]) * metric.scale
            for r, d in pairs
            if metric.key in r.test and metric.key in d.test
        ]
        paired = f"{sum(diffs) / len(diffs):+.2f} ({', '.join(f'{x:+.2f}' for x in diffs)})" if diffs else "-"
        above = f"{sum(x > 0 for x in diffs)} of {len(diffs)}" if diffs else "-"
        lines.append(
            f"| `{setting_label(group, groups)}` | {','.join(str(r.seed) for r, _ in pairs)} "
            f"| {_median_ratio(pairs, lambda r: r.forward_flops)} | {_median_ratio(pairs, lambda r: r.fit_seconds)} "
            f"| {paired} | {above} |"
        )
    return lines


def markdown_table(results: Sequence[RunResult]) -> str:
    """One markdown table per task (sweep): a row per configuration with its parameters, FLOPs,
    times and test metrics; a value over several seeds reads ``mean (min-max)``, a time ``median
    (min-max)``. A scaling sweep also gets its trends per router (:func:`_scaling_trends`), a Pareto
    sweep its MoEs against the dense run of their width (:func:`_pareto_pairs`)."""
    groups = group_results(results)
    out = []
    for task in dict.fromkeys(g.task_name for g in groups):
        task_groups = [g for g in groups if g.task_name == task]
        seeds = sum(len(g.runs) for g in task_groups)
        out += [f"#### {task} ({len(task_groups)} configurations, {seeds} runs)", ""]
        machines = Counter(run.machine for g in task_groups for run in g.runs if run.machine)
        if machines:
            out += ["Ran on: " + "; ".join(f"{name} ({count} runs)" for name, count in machines.most_common()), ""]
        out += [*_task_table(task_groups), ""]
        if figure_kind(task) == "scaling":
            out += ["Trends against the number of experts:", "", *_scaling_trends(task_groups), ""]
        if figure_kind(task) == "pareto" and any(g.family == "dense" for g in task_groups):
            out += ["Against the dense run of the same width and seed:", "", *_pareto_pairs(task_groups), ""]
    out.append(_table_note(benched=any(run.bench_step_seconds is not None for run in results)))
    return "\n".join(out) + "\n"


_NOTE_START = "Values over several seeds:"
_BENCH_COLUMN = "| bench step ms |"


def _table_note(benched: bool) -> str:
    """The closing paragraph of :func:`markdown_table`: how to read its cells."""
    note = (
        f"{_NOTE_START} mean (min-max), times median (min-max): a run slowed by other work on the"
        " machine moves the mean, not the median. Training FLOPs = 3 x forward FLOPs x examples trained on."
    )
    if benched:
        note += (
            " Step ms: the run's own mean batch time (data loading included); bench step ms: its model's training"
            " step timed by scripts/bench_models.py."
        )
    return note


def _task_sections(table: str) -> dict[str, str]:
    """The per-task sections of a :func:`markdown_table` text, by task name, in order, without the
    closing note."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in table.splitlines():
        if line.startswith("#### "):
            current = sections.setdefault(line.split()[1], [])
        elif line.startswith(_NOTE_START):
            current = None
        if current is not None:
            current.append(line)
    return {task: "\n".join(lines).rstrip("\n") + "\n" for task, lines in sections.items()}


def merge_markdown_tables(existing: str, new: str) -> tuple[str, list[str]]:
    """``existing`` (an earlier ``results.md``) with the task sections of ``new`` put in place of its
    sections of the same tasks (new tasks go last), and the names of the tasks kept from ``existing``.

    A figure folder keeps the figures of the sweeps that a later drawing did not include; this keeps
    their tables alike, so one sweep can be redrawn from its records while another's section (drawn
    from records that are no longer at hand) stays."""
    sections = _task_sections(existing)
    drawn = _task_sections(new)
    kept = [task for task in sections if task not in drawn]
    sections.update(drawn)
    body = "\n".join(sections.values())
    return body + "\n" + _table_note(benched=_BENCH_COLUMN in body) + "\n", kept


# ---------------------------------------------------------------------------------------------
# Figures


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tick_label(value: float) -> str:
    """A short tick label: ``300``, ``0.5``, ``24T`` (SI prefixes from 10^4 on)."""
    if abs(value) >= 1e4:
        for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
            if abs(value) >= scale:
                return f"{value / scale:.3g}{unit}"
    return f"{value:.4g}"


def _log_x(ax, base: float = 10) -> None:
    """A log x axis with short plain labels; minor ticks are labelled at 2, 3 and 5 x 10^n, or all of
    them where the axis spans less than 0.6 of a decade (a sweep of one model size)."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=base)

    def minor(value: float, _) -> str:
        low, high = sorted(ax.get_xlim())
        mantissa = round(value / 10 ** math.floor(math.log10(value)), 6)
        narrow = low > 0 and math.log10(high / low) < 0.6
        return _tick_label(value) if narrow or mantissa in (2.0, 3.0, 5.0) else ""

    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _tick_label(value)))
    ax.xaxis.set_minor_formatter(FuncFormatter(minor))


def _errors(stats: Sequence[Stat], scale: float = 1.0, median: bool = False) -> list[list[float]]:
    """Matplotlib's asymmetric error bars: the distances from the means (or medians) to the min and the max."""
    return [
        [(s.center(median) - s.low) * scale for s in stats],
        [(s.high - s.center(median)) * scale for s in stats],
    ]


def _families(groups: Sequence[Group]) -> list[str]:
    return list(dict.fromkeys(g.family for g in groups))


def _series(
    ax,
    groups: Sequence[Group],
    x: Callable[[RunResult], float | None],
    y: Callable[[RunResult], float | None],
    y_scale: float = 1.0,
    y_median: bool = False,
) -> None:
    """One line per family through the configurations' points (sorted by x), with min-max error bars
    in y (and in x where x varies between seeds). A point sits at the median x over the seeds (x is a
    FLOP count or number of experts, the same for every seed, or a time) and at the mean y, or the
    median with ``y_median`` (y a time)."""
    for family in _families(groups):
        points = [(g.stat(x), g.stat(y)) for g in groups if g.family == family]
        points = sorted(((sx, sy) for sx, sy in points if sx is not None and sy is not None), key=lambda p: p[0].median)
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.errorbar(
            [s.median for s in xs],
            [s.center(y_median) * y_scale for s in ys],
            xerr=_errors(xs, median=True),
            yerr=_errors(ys, y_scale, median=y_median),
            marker="o",
            capsize=3,
            label=family,
        )


def _save(fig, out: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    """Write ``fig`` to ``out`` as a PNG; ``rect`` is the part of the figure its axes may fill."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out


def _primary_metric(results: Iterable[RunResult]) -> _Metric:
    return _metrics_of(results)[0]


def plot_pareto(results: Sequence[RunResult], out: Path) -> Path:
    """Test accuracy against training FLOPs (left) and against training time (right), one line per
    family through its model sizes; writes a PNG to ``out``. The time is steps x the benchmarked step
    time when every run has one (:func:`attach_step_times`), else each run's recorded fit time."""
    plt = _pyplot()
    groups = group_results(results)
    metric = _primary_metric(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if all(run.bench_seconds is not None for run in results):
        time, time_label = (lambda r: r.bench_seconds), "training time (s): steps x benchmarked step time"
    else:
        time, time_label = (lambda r: r.fit_seconds), "training wall time (s), as recorded"
    for ax, x, xlabel in (
        (axes[0], lambda r: r.training_flops, "training FLOPs (3 x forward x images)"),
        (axes[1], time, time_label),
    ):
        _series(ax, groups, x, lambda r: r.test.get(metric.key), metric.scale)
        _log_x(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric.label)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels, clear of the points
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("Pareto: mean accuracy and median time over seeds, bars = min-max")
    return _save(fig, out, rect=(0, 0.06, 1, 1))


def plot_scaling(results: Sequence[RunResult], out: Path) -> Path:
    """Training step time (left) and test accuracy (right) against the number of experts (log2
    axis), one line per router; writes a PNG to ``out``. The step time is the benchmarked one when
    every run has it (:func:`attach_step_times`), else each run's recorded mean batch time. Dense runs
    of the sweep (no experts) are the reference: a dashed horizontal line at their median step time and
    mean accuracy, shaded from their min to their max over the seeds."""
    plt = _pyplot()
    groups = group_results(results)
    moe_groups = [g for g in groups if all(run.num_experts > 0 for run in g.runs)]
    dense_groups = [g for g in groups if g not in moe_groups]
    metric = _primary_metric(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if all(run.bench_step_seconds is not None for run in results):
        step, step_label = (lambda r: r.bench_step_seconds), "training step (ms, benchmarked)"
    else:
        step, step_label = (lambda r: r.batch_seconds), "training step (ms, as recorded, data loading included)"

    def accuracy(run: RunResult) -> float | None:
        return run.test.get(metric.key)

    _series(axes[0], moe_groups, lambda r: r.num_experts, step, 1e3, y_median=True)
    _series(axes[1], moe_groups, lambda r: r.num_experts, accuracy, metric.scale)
    for ax, y, scale, median in ((axes[0], step, 1e3, True), (axes[1], accuracy, metric.scale, False)):
        _reference_lines(ax, dense_groups, y, scale, median)
    axes[0].set_ylabel(step_label)
    axes[1].set_ylabel(metric.label)
    for ax in axes:
        _log_x(ax, base=2)
        ax.set_xlabel("experts per MoE layer")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle("Scaling experts: median step time and mean accuracy over seeds, bars = min-max")
    return _save(fig, out)


def _reference_lines(
    ax, groups: Sequence[Group], y: Callable[[RunResult], float | None], y_scale: float, y_median: bool
) -> None:
    """A dashed horizontal line per group at the mean (or median) of ``y`` over its runs, its min-max
    range shaded."""
    for group in groups:
        stat = group.stat(y)
        if stat is None:
            continue
        ax.axhline(stat.center(y_median) * y_scale, linestyle="--", color="0.35", label=group.family)
        ax.axhspan(stat.low * y_scale, stat.high * y_scale, color="0.35", alpha=0.12, linewidth=0)


def plot_language(results: Sequence[RunResult], out: Path) -> Path:
    """Test perplexity against training FLOPs, one line (or point) per family; writes a PNG to ``out``."""
    plt = _pyplot()
    groups = group_results(results)
    metric = _primary_metric(results)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    _series(ax, groups, lambda r: r.training_flops, lambda r: r.test.get(metric.key), metric.scale)
    _log_x(ax)
    ax.set_xlabel("training FLOPs (3 x forward x tokens)")
    ax.set_ylabel(metric.label)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("Language models: mean over seeds, bars = min-max")
    return _save(fig, out)


def plot_ablations(results: Sequence[RunResult], out: Path) -> Path:
    """One bar chart per ablation (task): a bar per setting at the mean test metric over seeds,
    error bars min-max; the y axis is zoomed on the bars (it does not start at 0). Writes a PNG."""
    plt = _pyplot()
    groups = group_results(results)
    tasks = list(dict.fromkeys(g.task_name for g in groups))
    bars = [max(2, sum(g.task_name == task for g in groups)) for task in tasks]  # panel width follows its bars
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(max(6.0, 2.1 * sum(bars)), 4.2), squeeze=False, gridspec_kw={"width_ratios": bars}
    )
    for ax, task in zip(axes[0], tasks, strict=True):
        task_groups = [g for g in groups if g.task_name == task]
        metric = _primary_metric(run for g in task_groups for run in g.runs)
        stats = [g.stat(lambda r, key=metric.key: r.test.get(key)) for g in task_groups]
        shown = [(g, s) for g, s in zip(task_groups, stats, strict=True) if s is not None]
        if not shown:
            continue
        labels = [_short_label(setting_label(g, task_groups)) for g, _ in shown]
        values = [s for _, s in shown]
        ax.bar(range(len(values)), [s.mean * metric.scale for s in values], yerr=_errors(values, metric.scale))
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        low = min(s.low for s in values) * metric.scale
        high = max(s.high for s in values) * metric.scale
        margin = max(high - low, abs(high) * 0.01, 1e-6)
        ax.set_ylim(low - margin, high + margin)
        ax.set_ylabel(metric.label)
        ax.set_title(task.removeprefix("results_"))
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Ablations: mean over seeds, bars = min-max (y axis not from 0)")
    return _save(fig, out)


def _short_label(label: str) -> str:
    """``"normalize=false"`` from ``"model.moe_kwargs.normalize=false"``; one line per override."""
    return (
        "\n".join(
            part.split("=", 1)[0].rsplit(".", 1)[-1] + "=" + part.split("=", 1)[1]
            for part in label.split(",")
            if "=" in part
        )
        or label
    )


_PLOTS: dict[str, Callable[[Sequence[RunResult], Path], Path]] = {
    "pareto": plot_pareto,
    "scaling": plot_scaling,
    "language": plot_language,
    "ablations": plot_ablations,
}


def plot_all(results: Sequence[RunResult], out_dir: Path) -> list[Path]:
    """The figure of every results sweep among ``results`` (:func:`figure_kind` of their task):
    ``<out_dir>/<kind>.png``. Runs of other experiments get no figure."""
    by_kind: dict[str, list[RunResult]] = {}
    for run in results:
        kind = figure_kind(run.task_name)
        if kind is not None:
            by_kind.setdefault(kind, []).append(run)
    return [_PLOTS[kind](runs, Path(out_dir) / f"{kind}.png") for kind, runs in by_kind.items()]
