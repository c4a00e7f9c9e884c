"""The machine's matmul rate: the physical limit against which the benchmarks report GFLOP/s and MFU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["matmul_peak", "device_sync"]


def matmul_peak(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str]:
    """``(FLOP/s, description)`` of one large square matmul in ``dtype`` (8192^3 on a GPU, 4096^3 on a CPU), the
    best of 3 after a warm-up.

    On a CPU in float32 the product also runs through oneDNN, and the faster library sets the peak: torch's float32
    ``mm`` calls MKL, which on AMD CPUs reaches less of the FMA units' rate than oneDNN does (on a Zen 4 EPYC with
    AVX-512, 189-198 against 214-222 GFLOP/s on 2 cores). bf16 products on a CPU already run on oneDNN."""
    device = torch.device(device)
    n = 8192 if device.type == "cuda" else 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    what = f"{n}^3 {str(dtype).removeprefix('torch.')} matmul"
    rate = 2 * n**3 / _best_of_3(lambda: torch.mm(a, b), device)
    onednn = _onednn_mm(a, b) if device.type == "cpu" and dtype == torch.float32 else None
    if onednn is None:
        return rate, what
    onednn_rate = 2 * n**3 / _best_of_3(onednn, device)
    if onednn_rate > rate:
        return onednn_rate, f"{what}, oneDNN; torch.mm {rate / 1e9:.1f}"
    return rate, f"{what}, torch.mm; oneDNN {onednn_rate / 1e9:.1f}"


def _best_of_3(product: Callable[[], object], device: torch.device) -> float:
    product()  # the warm-up: allocations, the BLAS's threads, the GPU's clocks
    best = float("inf")
    for _ in range(3):
        device_sync(device)
        start = time.perf_counter()
        product()
        device_sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _onednn_mm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """``a @ b`` through oneDNN's matmul (the op Inductor's CPU linear fusions call), or None where this torch has
    none or its product is not float32's (a reduced-precision math mode would measure another computation)."""
    try:
        linear = torch.ops.mkldnn._linear_pointwise
        b_t = b.t().contiguous()  # a linear layer's [out, in] weight
        product = linear(a[:64], b_t, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    if not torch.allclose(product, a[:64] @ b, rtol=1e-4, atol=1e-3):
        return None
    return lambda: linear(a, b_t, None, "none", [], "")


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): what the benchmarks do around every timed span."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
