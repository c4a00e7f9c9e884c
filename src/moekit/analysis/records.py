"""Run records: the ``results.json`` every training run writes, and reading a sweep's records back.

:func:`build_run_record` is what ``scripts/train.py`` writes into its output folder (rank 0, atomically);
:func:`load_results` reads every record under a folder as :class:`RunResult` rows (refusing a record of a newer
:data:`RECORD_VERSION`), and :func:`archive_records` copies a sweep's records (kilobytes, beside megabytes of
checkpoints) to a folder that can be committed with the figures drawn from them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moekit.utils.atomic import write_json_atomic
from moekit.utils.machine import machine_info, machine_label

if TYPE_CHECKING:  # reading records (plot_results.py) imports no torch
    from torch import nn

__all__ = [
    "RESULTS_FILE",
    "RECORD_VERSION",
    "OLDEST_READABLE_VERSION",
    "RecordError",
    "RunResult",
    "model_family",
    "build_run_record",
    "step_time_key",
    "load_results",
    "archive_records",
]

RESULTS_FILE = "results.json"
RECORD_VERSION = 1
"""Bumped when a field of the record changes meaning; a record of a higher version is refused on reading."""
OLDEST_READABLE_VERSION = 1  # the oldest version RunResult.from_record reads (1 is the only one so far)


class RecordError(ValueError):
    """A ``results.json`` this moekit must not read (a newer version, a missing field); it names the file and fix."""


def _git_commit(directory: Path) -> str | None:
    """The commit checked out in ``directory``, ``+dirty`` when files differ; None outside a checkout that tracks
    ``directory``'s files (moekit installed into a virtual environment inside another project's checkout)."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True)
        return run.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        git("ls-files", "--error-unmatch", "--", ".")  # fails where it tracks no file there
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


_LAYER_SETTINGS = "top_k slots_per_expert capacity_factor eval_capacity_factor batch_priority normalize".split()


def _moe_layer_settings(net: nn.Module) -> list[dict[str, Any]]:
    """Per MoE layer of ``net``: its name, registry type, experts, and the routing settings it has
    (top-k, slots per expert, capacity factors, BPR, Soft MoE's l2 normalisation)."""
    from moekit.moe import moe_layers

    layers = []
    for name, layer in moe_layers(net):
        entry: dict[str, Any] = {
            "name": name,
            "layer": getattr(layer, "registry_name", type(layer).__name__),
            "num_experts": layer.experts.num_experts,
        }
        owners = (layer, getattr(layer, "capacity", None))  # tokens-choice keeps BPR with its capacity settings
        for key in _LAYER_SETTINGS:
            owner = next((o for o in owners if o is not None and hasattr(o, key)), None)
            if owner is not None:
                entry[key] = getattr(owner, key)
        layers.append(entry)
    return layers


def model_family(net: nn.Module) -> str:
    """A short name for the kind of network, for grouping runs: the router of its MoE layers
    (``dense``, ``soft_moe``, ``top1``, ``top2``, ``experts_choice``, ...), with ``+mod`` when blocks route
    tokens around them (Mixture-of-Depths), prefixed with ``transformer/`` or ``lstm/`` for language models."""
    from moekit.moe import depth_routers, moe_layers

    routers = []
    for _, layer in moe_layers(net):
        name = getattr(layer, "registry_name", type(layer).__name__)
        top_k = getattr(layer, "top_k", None)
        routers.append(f"top{top_k}" if name == "top_k" and top_k is not None else name)
    router = "+".join(dict.fromkeys(routers)) or "dense"
    if next(depth_routers(net), None) is not None:
        router += "+mod"
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
    precision_reason: str = "as configured",
) -> dict[str, Any]:
    """The content of ``results.json`` for one run of ``scripts/train.py`` (:func:`moekit.commands.train.train`).

    Args:
        run_config: the resolved run config (everything but ``hydra``).
        overrides: the command-line / sweep overrides of the run (``hydra.overrides.task``).
        net: the trained network.
        summary: its :class:`~moekit.models.summary.ModelSummary` (images) or
            :class:`~moekit.models.summary.LMSummary` (tokens); None when it could not be measured.
        counter: the run's :class:`~moekit.callbacks.ThroughputMonitor` (examples, batches, times).
        metrics: what :func:`~moekit.commands.train.train` returns (``val/*`` after fit, ``test/*`` after test).
        trainer: the Lightning trainer (steps, world size, the best checkpoint's score).
        precision_reason: why the run trained in its precision (:func:`~moekit.commands.common.choose_precision`).
    """
    from moekit.moe import kernel_choices

    per_token = hasattr(summary, "flops_per_token") if summary is not None else counter.count == "elements"  # LM
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
            "precision": {"value": (run_config.get("trainer") or {}).get("precision"), "reason": precision_reason},
        },
        "metrics": {
            "val": _split_metrics(metrics, "val"),
            "test": _split_metrics(metrics, "test"),
            "best_val": None
            if best_score is None
            else {"monitor": checkpoint.monitor, "value": float(best_score), "checkpoint": checkpoint.best_model_path},
        },
        "machine": machine_info(),
        "kernel_choices": kernel_choices.changes(),  # [] when the run used moekit.moe.kernel_choices as shipped
        "finished_at": datetime.now(timezone.utc).isoformat(),  # which of two records of one seed is the newer
        "git_commit": _git_commit(Path(__file__).resolve().parent),
        "config": dict(run_config),
    }


def step_time_key(model_config: Mapping[str, Any], batch_size: int, precision: str) -> str:
    """What makes two training steps the same work: the resolved model config, the batch size (images
    or sequences) and the trainer's precision, as one canonical string."""
    return json.dumps(
        {"model": model_config, "batch_size": int(batch_size), "precision": str(precision)}, sort_keys=True
    )


def _parse_override(override: str) -> tuple[str, str]:
    """``("model.embed_dim", "64")`` from ``"model.embed_dim=64"`` (also ``+key=`` / ``++key=``)."""
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


_NOT_SETTING = frozenset({"seed", "results", "data.root", "ckpt_path", "skip_finished"})
"""Overrides that say where a run reads and writes or how it was started, not what it trains: the keys Hydra
leaves out of a sweep job's folder name (``configs/hydra/default.yaml``, with every ``paths.*``), and the seed. A
job resumed with ``ckpt_path=auto`` or rerun with ``skip_finished=false`` stays a seed of its configuration."""


def _in_setting(key: str) -> bool:
    return key not in _NOT_SETTING and not key.startswith("paths.")


_REQUIRED = dict(task_name=str, overrides=list, model=dict, params=dict, flops=dict, training=dict, metrics=dict)
_JSON_TYPES = {str: "a string", list: "a list", dict: "an object", int: "a whole number"}


def _check_record(record: Mapping[str, Any], file: Path) -> None:
    """Raise :class:`RecordError` (naming ``file``, the bad value and the fix) for a record this moekit can't read."""
    leave_out = f"move its run folder {str(file.parent)!r} out of the folder read"
    version = record.get("version")
    if version is None:
        raise RecordError(
            f"{str(file)!r} has no 'version', which every run record of scripts/train.py has: it is not a moekit run "
            f"record (another tool's results.json?); {leave_out}"
        )
    if isinstance(version, bool) or not isinstance(version, int) or version < OLDEST_READABLE_VERSION:
        raise RecordError(
            f"{str(file)!r} has version {version!r}, which no moekit writes (a whole number, {OLDEST_READABLE_VERSION}"
            f" to {RECORD_VERSION}): the file was edited; rerun its run or {leave_out}"
        )
    if version > RECORD_VERSION:
        raise RecordError(
            f"{str(file)!r} is a run record of version {version}, written by a newer moekit; this moekit reads "
            f"versions {OLDEST_READABLE_VERSION} to {RECORD_VERSION}: upgrade moekit (pip install -U moekit, or git "
            f"pull in its checkout) to read it, or {leave_out}"
        )
    fields = [(key, record.get(key), kind) for key, kind in _REQUIRED.items()]  # every record has them
    model, training = record.get("model"), record.get("training")
    if isinstance(model, dict) and isinstance(training, dict):  # else the loop names them
        fields += [("model.family", model.get("family"), str)]
        fields += [("training.world_size", training.get("world_size", 1), int)]
    for key, value, kind in fields:
        if isinstance(value, bool) or not isinstance(value, kind) or value == "" or (kind is int and value < 1):
            raise RecordError(
                f"{str(file)!r} has {'no' if value is None else f'{value!r} as its'} {key!r}, where every version-"
                f"{version} run record has {_JSON_TYPES[kind]}{' from 1' if kind is int else ''}: the file was cut "
                f"short or edited; rerun its run or {leave_out}"
            )


def _timestamp(value: Any, file: Path) -> float | None:
    """Seconds since the epoch of a record's ``finished_at`` (ISO 8601), None when it has none."""
    try:
        return None if value is None else datetime.fromisoformat(value).timestamp()
    except (TypeError, ValueError, OverflowError, OSError):
        raise RecordError(
            f"{str(file)!r} has finished_at {value!r}, not an ISO 8601 time (2026-01-31T12:00:00+00:00); correct or "
            "delete that field (the file's modification time then dates the run), or rerun its run"
        ) from None


@dataclass(frozen=True)
class RunResult:
    """One run, read from its ``results.json``.

    Attributes:
        path: the run's folder.
        task_name: the experiment's ``task_name`` (``results_pareto``, ...).
        family: :func:`model_family` of its network.
        seed: the run's seed.
        setting: its overrides but the seed and where it reads and writes (``ckpt_path``, ``paths.*``, ...), as sorted
            ``(key, value)`` pairs: runs with the same ``task_name`` and setting are seeds of one configuration.
        num_experts: the most experts of any MoE layer (0 for a dense network).
        total_params, active_params: parameters in all, and used per token.
        forward_flops: forward FLOPs per example (image or token).
        training_flops: 3 x ``forward_flops`` x the examples trained on.
        fit_seconds: wall time of training (validation included).
        batch_seconds: mean time of a training batch (data loading included).
        throughput: mean training examples per second.
        examples_seen: training examples (images, or tokens without padding) of the run, of all its processes, before
            a resume too.
        step_key: :func:`step_time_key` of its model, batch size and precision (None for a record without its config).
        bench_step_seconds, bench_examples_per_step: the benchmarked step time of its model and the examples of that
            step (one process's batch: :func:`attach_step_times`), or None.
        val, test: the final validation metrics and the test metrics (``acc``, ``acc_top5`` or ``ppl``, ``bpb``, ...).
        machine: what it ran on (:func:`machine_label`), None for a record without it.
        world_size: the processes that trained it (each on its own batch of the data config's batch size).
        finished_at, file_mtime: when the run wrote its record (None in records from before ``finished_at``) and
            the modification time of its ``results.json`` (None when not read from a file), in epoch seconds.
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
    world_size: int = 1
    finished_at: float | None = None
    file_mtime: float | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any], path: Path, *, file_mtime: float | None = None) -> RunResult:
        """Read the fields of a ``results.json`` record (:func:`build_run_record`) of the run folder ``path``; a
        :class:`RecordError` for a record of a newer version (from a newer moekit) or without a field all have."""
        _check_record(record, path / RESULTS_FILE)
        pairs = (_parse_override(o) for o in record["overrides"])
        training = record["training"]
        config = record.get("config") or {}
        step_key = None
        if {"model", "data", "trainer"} <= set(config) and "batch_size" in config["data"]:
            step_key = step_time_key(config["model"], config["data"]["batch_size"], config["trainer"]["precision"])
        return cls(
            path=path,
            task_name=record["task_name"],
            family=record["model"]["family"],
            seed=record.get("seed"),
            setting=tuple(sorted((k, v) for k, v in pairs if _in_setting(k))),
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
            world_size=training.get("world_size", 1),
            finished_at=_timestamp(record.get("finished_at"), path / RESULTS_FILE),
            file_mtime=file_mtime,
        )

    @property
    def bench_seconds(self) -> float | None:
        """The run's training time at its benchmarked step time: steps x ``bench_step_seconds`` (None
        without a step time): each process's steps, which the processes take side by side."""
        if self.bench_step_seconds is None or not self.bench_examples_per_step or self.examples_seen is None:
            return None
        return self.bench_step_seconds * self.examples_seen / (self.bench_examples_per_step * self.world_size)


def load_results(folder: str | os.PathLike) -> list[RunResult]:
    """Every ``results.json`` under ``folder`` (any depth), sorted by path.

    Raises:
        FileNotFoundError: ``folder`` does not exist or holds no ``results.json``.
        ValueError: a file is not a readable run record, or a :class:`RecordError`: a record of a newer version
            (written by a newer moekit) or without a field every record has (the message names it).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder; give the sweep folder, e.g. logs/results/pareto")
    files = sorted(folder.rglob(RESULTS_FILE))
    if not files:
        raise FileNotFoundError(
            f"no {RESULTS_FILE} under {str(folder)!r}: every finished run of scripts/train.py writes one in its "
            "output folder; run a sweep first (python scripts/train.py -m results=pareto) or give "
            "the folder it wrote (logs/results/pareto)"
        )
    results = []
    for file in files:
        try:
            record = json.loads(file.read_text())
            if not isinstance(record, dict):
                raise TypeError(f"it holds a JSON {type(record).__name__}, not an object")
            results.append(RunResult.from_record(record, file.parent, file_mtime=file.stat().st_mtime))
        except RecordError:
            raise  # names the file and the fix
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
        ValueError: ``dest`` is a file, a record is unreadable, or differs from the one archived and ``replace``
            is false.
    """
    source, dest = Path(source), Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"the archive {str(dest)!r} is a file; give a folder (new or existing) for the records")
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
