"""Where a step's time goes: the operators with the most self time over a few steps (``torch.profiler``), as a
markdown table. With ``--profile`` the layer benchmark prints one per moekit layer and the model benchmark one per
model (the dense twin too); ``make gpu-check`` puts them in its report.

On a GPU the time is the kernels' (self device time); on the CPU it is the calling thread's CPU time, in which the
products that :mod:`moekit.moe.cpu_threads` runs on worker threads count as the self time of the kernel's autograd
function (``_LoopGroupedLinear``, ``_LoopGroupedLinearBackward``) that waits for them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from moekit.analysis.peak import device_sync

__all__ = ["OperatorTime", "top_operators", "print_top_operators"]


@dataclass(frozen=True)
class OperatorTime:
    name: str
    ms_per_step: float
    share: float  # of all self time (CPU) or of all kernel time (GPU) over the profiled steps


def top_operators(
    step: Callable[[], object], device: torch.device, steps: int = 3, rows: int = 8
) -> list[OperatorTime]:
    """Profile ``steps`` calls of ``step`` (after one untimed call) and return the ``rows`` operators with the most
    self time on ``device``, most first."""
    if steps < 1 or rows < 1:
        raise ValueError(f"top_operators: steps={steps} and rows={rows} must be positive")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cpu":  # a CUDA build of torch without a GPU: kineto's "ERROR: gpuGetDeviceCount failed"
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    step()
    device_sync(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one profile, one cycle: all kept
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            device_sync(device)
    events = prof.key_averages()
    if device.type == "cuda":  # operators by the kernel time they launched, over the time of every kernel
        times = {e.key: e.self_device_time_total for e in events if e.device_type == DeviceType.CPU}
        total = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    else:
        times = {e.key: e.self_cpu_time_total for e in events}
        total = sum(times.values())
    ranked = sorted(times.items(), key=lambda item: item[1], reverse=True)[:rows]  # microseconds over all steps
    total = total or 1.0
    return [OperatorTime(name, us / 1e3 / steps, us / total) for name, us in ranked]


def print_top_operators(title: str, step: Callable[[], object], device: torch.device, steps: int = 3, rows: int = 8):
    """Print :func:`top_operators` of ``step`` under a ``####`` heading."""
    where = "self GPU time" if device.type == "cuda" else "self CPU time of the calling thread"
    ops = top_operators(step, device, steps, rows)  # before the heading: nothing it prints splits the table
    print(f"\n#### Where the time goes: {title} ({where}, {steps} steps)\n")
    print("| operator | ms / step | share |")
    print("|---|---:|---:|")
    for op in ops:
        print(f"| `{op.name}` | {op.ms_per_step:.2f} | {op.share:.1%} |")
