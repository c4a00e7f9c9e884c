"""The layer benchmarks' timing harness: candidates timed forward + backward in interleaved rounds, in a backend's
device and precision (``scripts/bench_moe.py``: :mod:`moekit.analysis.bench_layers`, its ``products`` table
:mod:`moekit.analysis.bench_products`)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moekit.analysis.peak import device_sync

__all__ = ["Backend", "Candidate", "timed_step", "time_candidates"]


@dataclass(frozen=True)
class Backend:
    """Where and in which precision the layers run: float32, or bf16 autocast (routers stay float32)."""

    device: torch.device = torch.device("cpu")
    autocast: torch.dtype | None = None

    def sync(self) -> None:
        device_sync(self.device)

    def precision(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)


@dataclass
class Candidate:
    name: str
    module: nn.Module
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda m, x: m(x)


def timed_step(candidate: Candidate, x: torch.Tensor, grad: torch.Tensor, backend: Backend) -> float:
    """Seconds of one forward + backward of ``candidate`` on ``x`` (``grad`` the output's gradient), gradients
    cleared first."""
    for p in candidate.module.parameters():
        p.grad = None
    x.grad = None
    backend.sync()
    start = time.perf_counter()
    with backend.precision():
        y = candidate.forward(candidate.module, x)
    y.backward(grad)
    backend.sync()
    return time.perf_counter() - start


def time_candidates(
    candidates: list[Candidate], x: torch.Tensor, rounds: int, backend: Backend = Backend()
) -> dict[str, float]:
    """Median forward+backward seconds of each candidate, measured in interleaved rounds after one
    warm-up step. A candidate more than 20x slower than the fastest is timed once (its ratio is
    then far from any target; the rounds would only cost minutes). ``x`` must be on
    ``backend.device``; the candidates' modules are moved there."""
    grads, warm = {}, {}
    for c in list(candidates):
        try:
            c.module.to(backend.device).train()
            with torch.no_grad(), backend.precision():
                grads[c.name] = torch.randn_like(c.forward(c.module, x))
            warm[c.name] = timed_step(c, x, grads[c.name], backend)
        except (RuntimeError, MemoryError) as err:  # e.g. a reference that gathers a weight copy per token
            print(f"({c.name}: skipped, {str(err).splitlines()[0][:120]})")
            candidates.remove(c)
            c.module.to("cpu")
    fastest = min(warm.values())
    times: dict[str, list[float]] = {c.name: [] for c in candidates}
    for r in range(rounds):
        for c in candidates:
            if r == 0 or warm[c.name] < 20 * fastest:
                times[c.name].append(timed_step(c, x, grads[c.name], backend))
    return {name: statistics.median(ts) for name, ts in times.items()}
