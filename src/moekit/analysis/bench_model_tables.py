"""The model benchmark's output (:mod:`moekit.analysis.bench_models`): its markdown tables and their JSON records."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from moekit.utils.format import si

if TYPE_CHECKING:
    from moekit.analysis.bench_models import Candidate, StepTiming

__all__ = ["describe", "print_table", "table_record", "utilisation", "vs_dense"]


def print_table(
    title: str, candidates: list[Candidate], times: dict[str, StepTiming], peak: dict[torch.dtype, float] | None
) -> None:
    """A markdown table: sizes, FLOPs, the median step time (and its parameter update), throughput and
    the ratio to the dense baseline of the same run (of the same swept value, where the dense twin ran once per
    value); with ``peak`` (a GPU's measured matmul FLOP/s per dtype) also the achieved TFLOP/s and the MFU against
    the peak of the step's precision."""
    unit = candidates[0].unit
    header = (
        f"| model | total params | active params / token | fwd FLOPs / {unit} | ms / step | update ms | {unit}s/s "
        "| vs dense |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|"
    if peak:
        header += " TFLOP/s | MFU |"
        rule += "---:|---:|"
    print(f"\n### {title}\n\n{header}\n{rule}")
    for c in candidates:
        t = times[c.name].seconds
        s = c.summary
        cells = [
            c.name,
            si(None if s is None else s.total_params),
            si(None if s is None else s.active_params_per_token),
            si(c.flops_per_example),
            f"{t * 1e3:.1f}",
            f"{times[c.name].update_seconds * 1e3:.1f}",
            f"{c.examples_per_step / t:,.0f}",
            f"{vs_dense(c, candidates, times):.2f}x",
        ]
        if peak:
            achieved, mfu = utilisation(c, t, peak)
            cells.append("n/a" if achieved is None else f"{achieved / 1e12:.2f}")
            cells.append("n/a" if mfu is None else f"{mfu:.1%}")
        print("| " + " | ".join(cells) + " |")
    from torch._dynamo.utils import counters  # here, not at the top: Dynamo's import takes seconds

    compiled = [c.name for c in candidates if c.cfg.task.get("compile")]
    if compiled and not counters["frames"]["ok"]:  # as on a torch 2.11 image with Module.compile
        print(f"\n(task.compile=true, yet Dynamo compiled no frame: the steps of {', '.join(compiled)} ran eagerly)")
    sys.stdout.flush()


def table_record(
    title: str, candidates: list[Candidate], times: dict[str, StepTiming], peak: dict[torch.dtype, float] | None = None
) -> dict[str, Any]:
    """A table as JSON: a row per model with its median step time, what it ran (the model's resolved
    config, batch size, precision: :func:`moekit.analysis.records.step_time_key`) and its sizes; with ``peak``
    also its achieved FLOP/s and MFU, as the printed table."""
    rows = []
    for c in candidates:
        s = c.summary
        rows.append(
            {
                "name": c.name,
                "overrides": c.overrides,
                "model_config": OmegaConf.to_container(c.cfg.model, resolve=True),
                "batch_size": int(c.batch[1].shape[0]),
                "precision": c.precision,
                "seconds_per_step": times[c.name].seconds,
                "update_seconds": times[c.name].update_seconds,
                "vs_dense": vs_dense(c, candidates, times),
                "examples_per_step": c.examples_per_step,
                "unit": c.unit,
                "flops_per_example": c.flops_per_example,
                "total_params": None if s is None else int(s.total_params),
                "active_params_per_token": None if s is None else float(s.active_params_per_token),
            }
        )
        if peak:
            rows[-1]["achieved_flops_per_second"], rows[-1]["mfu"] = utilisation(c, times[c.name].seconds, peak)
    return {"title": title, "rows": rows}


def utilisation(c: Candidate, seconds: float, peak: dict[torch.dtype, float]) -> tuple[float | None, float | None]:
    """``(achieved FLOP/s, MFU)`` of a training step of ``seconds``: 3x the forward FLOPs (forward + backward) over
    the time, and that over the peak of the step's precision; None where the FLOPs are unknown."""
    if c.flops_per_example is None:
        return None, None
    achieved = 3 * c.flops_per_example * c.examples_per_step / seconds
    return achieved, achieved / peak[c.compute_dtype]


def vs_dense(c: Candidate, candidates: list[Candidate], times: dict[str, StepTiming]) -> float:
    """``c``'s step time over its dense baseline's (``c.baseline``; the table's first row where none is named)."""
    return times[c.name].seconds / times[c.baseline or candidates[0].name].seconds


def describe(candidates: Sequence[Candidate]) -> str:
    """A table's setting: its first model's batch and clipping, and the precisions and optimizers of its rows."""
    c = candidates[0]
    images, targets = c.batch
    if c.unit == "token":
        shape = f"batch {targets.shape[0]} x {targets.shape[1]} tokens"
    else:
        shape = f"batch {images.shape[0]} images {'x'.join(map(str, images.shape[1:]))}"
    precisions = " / ".join(dict.fromkeys(c.precision for c in candidates))
    optim = " / ".join(dict.fromkeys(type(c.optimizer).__name__ for c in candidates))
    clip = f", clip {c.clip_val:g}" if c.clip_val else ""
    return f"{shape}, {precisions}, {optim}{clip}"
