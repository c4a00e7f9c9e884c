"""The machine's matmul rate: the physical limit against which the benchmarks report GFLOP/s and MFU."""

from __future__ import annotations

import time

import torch

__all__ = ["matmul_peak", "device_sync"]


def matmul_peak(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str]:
    """``(FLOP/s, description)`` of one large square matmul in ``dtype`` (8192^3 on a GPU, 4096^3 on a CPU), the
    best of 3 after a warm-up."""
    device = torch.device(device)
    n = 8192 if device.type == "cuda" else 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # the warm-up: allocations, the BLAS's threads, the GPU's clocks
    best = float("inf")
    for _ in range(3):
        device_sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        device_sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best, f"{n}^3 {str(dtype).removeprefix('torch.')} matmul"


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): what the benchmarks do around every timed span."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
