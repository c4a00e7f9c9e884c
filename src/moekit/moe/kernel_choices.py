"""Every kernel and code path moekit picks by device, dtype or shape, in one table, with what it was picked on.

The layers read these values when they run, so a user can try another choice on their own machine without editing
the library: ``moekit.moe.kernel_choices.ROW_BLOCK = 128``, ``kernel_choices.AUTO_KERNELS["cpu", "ragged"] =
"grouped_mm"``. Each choice gives the same values (up to rounding in reduced precision); the tests check every path
whichever is picked, and ``scripts/bench_moe.py`` / ``scripts/bench_models.py`` measure a change.

Unless a line says otherwise, the CPU figures are from the 2-core AMD EPYC, Zen 4, that exposes AVX-512 (torch
2.14.1, forward + backward, interleaved rounds in one process) and the GPU ones from an H100 or H200 (``make
gpu-check``); docs/performance.md has the runs. Choices made per machine at start-up rather than per call live with
their code: the training precision (``trainer.precision=auto``, :mod:`moekit.tasks.precision`, measured on the
machine) and Muon's Newton-Schulz dtype (:mod:`moekit.tasks.muon`).
"""

from __future__ import annotations

import torch

__all__ = [
    "AUTO_KERNELS",
    "PLANES_MIN_ROWS",
    "ROW_BLOCK",
    "MIN_EXPERTS_PER_THREAD",
    "SORT_RADIX_FROM",
    "SOFTMAX_PAD_LANES",
    "DISPATCH_GRADIENT",
    "COMBINE_BMM_MIN_MACS",
    "COMBINE_PAIR_DEVICES",
    "FAST_DROPOUT_DEVICES",
    "BASE_SOLVERS",
    "PATCHIFY_KERNELS",
]

# -- The experts' grouped products (moekit.moe.grouped_linear) --

# The kernel ``kernel="auto"`` runs, by (device type, "equal" | "ragged" groups); others: "loop". On CPUs one batched
# matmul beats the per-expert loop on equal groups (capacity buffers, Soft MoE's slots); on ragged ones the loop,
# spread over the cores where experts are many, is level with torch._grouped_mm or faster (1.03x slower in bf16 at 256
# experts). On an H100 grouped_mm runs bf16 and float32 without a host sync, where the loop reads the counts on the
# host; CUDA in another dtype (float16), or in float32 under torch.compile, falls back to the loop.
AUTO_KERNELS: dict[tuple[str, str], str] = {
    ("cpu", "equal"): "bmm",
    ("cpu", "ragged"): "loop",
    ("cuda", "equal"): "bmm",
    ("cuda", "ragged"): "grouped_mm",
}

# Rows per expert, on average, from which the CPU loop writes a gated expert's gate and up as two contiguous planes
# (a product per plane) rather than two views of one output: elementwise ops on halves of short rows ran up to 2x
# slower than on contiguous tensors. By the rows' dtype; others take bf16's. The top-2 layer: in float32 1.01-1.09x
# faster from 64 to 2048 rows per expert, 1.12x slower at 32; in bf16 1.02-1.08x faster from 512 rows, 1.04x and
# 1.08x slower at 256 and 128.
PLANES_MIN_ROWS: dict[torch.dtype, int] = {torch.float32: 128, torch.bfloat16: 512}

# oneDNN, which runs a CPU's bf16 and float16 matmuls, builds a kernel for every new shape (0.5-1 ms each, for
# products of 1-10 ms) and keeps the last 1024 built. Ragged experts bring new row counts every step, so on CPUs in
# those dtypes the loop splits each expert's product into a multiple of ROW_BLOCK rows and the rest: shapes from a
# bounded set, built once.
ROW_BLOCK = 64

# The CPU loop hands each intra-op thread a share of the experts (moekit.moe.cpu_threads) where there are at least
# this many non-empty experts per thread. One grouped product, forward + backward, float32: 1.01-1.20x the plain
# loop's speed with 32 to 256 experts of 32 to 128 rows (1.10-1.20x at 256 x 32); with 4 to 16 experts 0.88-1.06x,
# as their larger products split well over the BLAS's own threads.
MIN_EXPERTS_PER_THREAD = 16

# -- Routing, dispatch and combine (moekit.moe.routing, moekit.moe.dispatch) --

# On CPUs, from this many keys on, expert ids and Batch Prioritized Routing's priorities are sorted as int32 keys
# padded to 32,768 entries, the length from which torch's CPU sort runs a 1-D integer tensor as a parallel radix
# sort (shorter ones, and floats, get a comparison sort). 25,600 expert ids of 8-256 experts: 0.15-0.20 ms against
# 0.62-1.04; the priority order of 12,800 tokens: 0.18 ms against 0.69-0.77; at 8,192 ids of 8 experts the
# comparison sort was faster (0.09 ms against 0.18).
SORT_RADIX_FROM = 12288

# torch's CPU float32 softmax over a last dim shorter than a float vector runs a slow path. A router's softmax over
# E experts pads its rows with -inf to the vector's lanes, by torch's CPU capability, where E < lanes <= 4 E (the
# values are the same). [12800, 8]: 1.36 ms under AVX-512, 0.30 ms padded to 16, 0.13 ms under AVX2 (8 lanes,
# a full vector); 4-12 experts 1.8-5.2x faster padded, 2 experts 1.4x slower.
SOFTMAX_PAD_LANES: dict[str, int] = {"AVX512": 16, "AVX2": 8}

# The gradient of the dispatch's gather of each token's k copies, by device type; others: "gather" (each token sums
# its k rows of the output's gradient: no atomic adds, the same sum in every run; index_add_ took 15% of a 256-expert
# top-2 layer's time on an H200). On CPUs "index_add" (index_select's own backward) was 1.6x faster than the gather
# at k = 2-8.
DISPATCH_GRADIENT: dict[str, str] = {"cpu": "index_add"}

# The combine's per-token [1, k] @ [k, o] as one batched matmul where k * o reaches this, by device type, in float32
# and float64; elsewhere (other devices, bf16) a multiply and a sum. On CPUs MKL's batched GEMM was 1.3-1.7x faster
# than a multiply and a sum at o = 256-1024, k = 2-8; below 400 multiply-adds torch takes a naive kernel, 2x slower
# (o = 64-192). In bf16 the CPU's bmm was 1.4-1.9x slower than a multiply and a sum. On an H100 the bmm ran a
# tiny-tile GEMM kernel at ~1.2 ms per 32768 tokens, a quarter of a 256-expert top-2 layer's step.
COMBINE_BMM_MIN_MACS: dict[str, int] = {"cpu": 400}

# Device types where a top-2 combine that takes no bmm is one product and one fused multiply-add (w0 a0 + w1 a1)
# rather than a multiply and a sum over the pair: on CPUs 0.45-0.61x their time in bf16 (o = 64-1024), 0.74-1.00x in
# float32 (o = 64-192), forward + backward of 8192 tokens.
COMBINE_PAIR_DEVICES: set[str] = {"cpu"}

# -- Dropout, and BASE layers' assignment (moekit.moe.dropout, moekit.moe.assignment) --

# Device types whose dropout draws four 16-bit mask levels from each 64-bit random draw (and whose attention applies
# it to the probabilities: moekit.models.attention). torch's CPU dropout draws one double per element on one thread
# outside Intel's CPUs: [8192, 1024] float32 forward + backward 27 ms against F.dropout's 110.
FAST_DROPOUT_DEVICES: set[str] = {"cpu"}

# The balanced-assignment solver ``solver="auto"`` runs, by device type; others: "sync_free" (fixed rounds, no host
# read). On CPUs host reads are free, so the exact solver.
BASE_SOLVERS: dict[str, str] = {"cpu": "exact"}

# -- Models (moekit.models.stem) --

# How a ViT's patch embedding (a convolution whose kernel is its stride) runs, by device type; others: "conv".
# Forward + backward of ViT-S/16's at batch 512 (224 px, bf16, H200): 5.63 ms in cuDNN, 0.88 ms as one matmul of the
# patches. On a 2-core AMD EPYC (float32) oneDNN's convolution took 0.94-1.00x the matmul's time at 224 px with
# 16 px patches (batch 32), 0.77-0.83x at 3x32 px with 4 px patches (batch 256), but 3.4-3.7x at 1x28 px with 4 px
# patches (batch 128): CPUs keep the convolution.
PATCHIFY_KERNELS: dict[str, str] = {"cuda": "matmul", "cpu": "conv"}
