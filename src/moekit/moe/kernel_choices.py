"""Every kernel and code path moekit picks by device, dtype or shape, in one table, with what it was picked on.

The layers read these values when they run, so a user can try another choice on their own machine without editing
the library: ``kernel_choices.ROW_BLOCK = 128``, ``kernel_choices.AUTO_KERNELS["cpu", "ragged"] = "grouped_mm"``, or
:func:`set_choice` with ``"AUTO_KERNELS[cpu,ragged]=grouped_mm"``, which the benchmark scripts take as ``--choice``
to time a change beside the shipped table's figures. Each choice gives the same values (up to float rounding); the
tests check every path whichever is picked. :func:`changes` lists what differs from the table as shipped, as the
benchmarks' headers and a run's ``results.json`` record it.

Unless a line says otherwise, the CPU figures are from the 2-core AMD EPYC, Zen 4, that exposes AVX-512 (torch
2.14.1, forward + backward, interleaved rounds in one process) and the GPU ones from an H100 or H200 (``make
gpu-check``); docs/performance.md has the runs. Choices made per machine at start-up rather than per call live with
their code: the training precision (``trainer.precision=auto``, :mod:`moekit.tasks.precision`, measured on the
machine) and Muon's Newton-Schulz dtype (:mod:`moekit.tasks.muon`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from moekit.utils.machine import cpu_flags

__all__ = [
    "set_choice",
    "changes",
    "reset",
    "describe",
    "add_choice_argument",
    "apply_choice_argument",
    "cpu_matrix_units",
    "AUTO_KERNELS",
    "PLANES_MIN_ROWS",
    "ROW_BLOCK",
    "FLOAT32_ROW_BLOCK",
    "MIN_EXPERTS_PER_THREAD",
    "BF16_MIN_EXPERTS_PER_THREAD",
    "BF16_SPREAD_MIN_ROWS",
    "CPU_FLOAT32_MATMUL",
    "ONEDNN_FLOAT32_CPUS",
    "LOOP_WEIGHT_CAST",
    "FLOAT32_EXPERT_ROWS",
    "PADDED_GROUPS_MAX_PERCENT",
    "PADDED_GROUPS_MAX_PERCENT_DROPOUT",
    "BLOCK_PADDING_MAX_PERCENT",
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
# host; CUDA in another dtype (float16), or in float32 under torch.compile, falls back to the loop. Where CPU float32
# products run on oneDNN (CPU_FLOAT32_MATMUL below), equal groups take the loop too: 128 experts x 32 rows of
# 384 -> 1536, forward + backward, 70-74 ms against MKL's bmm 123 ms on a Zen 5 EPYC.
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

# The same block for float32 products where they run on oneDNN (CPU_FLOAT32_MATMUL). The dropless top-2 layer of 64
# SwiGLU experts (8192 rows, new counts every step), forward + backward on the Zen 5 EPYC, 6 interleaved rounds:
# 719 ms in blocks of 128 rows, 786 in blocks of 64, 649 with each expert's rows whole (an unbounded set of shapes,
# which the first rounds had not yet brought past oneDNN's 1024 kernels); with 256 experts all three level (212-221).
FLOAT32_ROW_BLOCK = 128

# The CPU loop spreads the experts over the intra-op threads (moekit.moe.cpu_threads) where there are at least
# this many non-empty experts per thread. One grouped product, forward + backward, float32: 1.01-1.20x the plain
# loop's speed with 32 to 256 experts of 32 to 128 rows (1.10-1.20x at 256 x 32); with 4 to 16 experts 0.88-1.06x,
# as their larger products split well over the BLAS's own threads (0.77-0.99x with 4 and 8 experts of 512-4096 rows
# on the 2-core Xeon with AMX, MKL).
MIN_EXPERTS_PER_THREAD = 16
# Fewer experts of bf16 rows are spread too, by matrix units, where there are at least BF16_MIN_EXPERTS_PER_THREAD
# non-empty experts per thread and BF16_SPREAD_MIN_ROWS rows per non-empty expert on average. On the 2-core Xeon with
# AMX (oneDNN's AMX kernels), one grouped product, counts spread 30%, spread over the two threads against not: forward
# + backward 1.03-1.29x faster with 8 and 16 experts of 128-3,900 rows; the forward alone (inference) 0.77-0.91x with
# 8 experts of 16-64 rows (a decoding step's), 0.85-1.01x at 128-256, 1.03-1.13x at 512-1,024. With the workers
# taking the experts longest first, 4 and 6 experts of 512-3,136 rows: forward + backward 1.02-1.17x and 1.00-1.33x,
# the forward alone 0.91-1.17x and 0.94-1.21x (4 experts in contiguous shares had lost, 0.88-0.93x). The width-128
# top-2 ViT's first MoE layer on its model input 1.05x (64.8 against 67.9 ms); training steps (the models in
# interleaved rounds in one process) of the width-128 top-2 ViT 1.01-1.04x (three runs), its top-1 1.01x, the MoE LM
# 1.02x.
BF16_MIN_EXPERTS_PER_THREAD: dict[str, int] = {"AMX": 2}
BF16_SPREAD_MIN_ROWS: dict[str, int] = {"AMX": 256}

# The library of float32 products on CPUs (moekit.moe.cpu_matmul): "auto" takes oneDNN on the CPU families of
# ONEDNN_FLOAT32_CPUS (vendor and family, as moekit.utils.machine.cpu_family names them) and MKL, torch's own
# operators, elsewhere; "mkl" or "onednn" sets it. A 4096^3 product ran at 178-192 GFLOP/s on MKL against 399-419 on
# oneDNN on a 2-core Zen 5 EPYC (AMD family 26), a linear layer's forward + backward 1.3-2.1x faster at widths of
# 64-8192; 189-198 against 214-222 on the Zen 4 that exposes AVX-512 (AMD family 25): near its run-to-run noise, so
# not taken there. By the CPU, not measured per process: every process on one kind of machine sums in one order.
CPU_FLOAT32_MATMUL = "auto"
ONEDNN_FLOAT32_CPUS: set[str] = {"AMD family 26"}
# How the CPU loop casts float32 weights for rows of another dtype (bf16 autocast), by matrix units; others:
# "expert", each expert's weights as its product runs (a tile in the cache, with FLOAT32_EXPERT_ROWS below), again in
# the backward; "bank", once, kept for the backward (in eager mode each expert's weights as its product runs, into a
# bf16 copy of the bank, the weight gradients written in float32 expert by expert; under torch.compile the whole bank
# before the products). On a 2-core Xeon with AMX, forward + backward of one SwiGLU bank (counts spread 30%), with the
# bank cast before the products: "bank" 1.07x faster with 8 experts of 2048 rows (256 -> 512), 1.08x, 1.03x, 1.08x,
# 1.14x and 1.02x with 32, 64, 64, 128 and 256 experts of 512, 256, 128, 64 and 32 rows (512 -> 256); the MoE LM's
# training step 1.03x, the width-128 top-2 ViT's 1.02x, its top-1 level. Cast inside the loop rather than before it:
# the dropless top-2 layer of 64 SwiGLU experts 1.08-1.10x faster (two runs), of 256 experts 1.02-1.03x slower.
LOOP_WEIGHT_CAST: dict[str, str] = {"AMX": "bank"}

# Where the loop casts per expert (LOOP_WEIGHT_CAST) under bf16 autocast on a CPU, an expert with fewer rows than
# this, by the CPU's matrix units, runs its products in float32 on its float32 weights (the rows cast up) instead of
# casting its weights to bf16 for them: such products wait on memory, and the cast reads the weights, writes them
# again and the product reads that copy. On a 2-core Xeon with AMX, forward + backward of one grouped product over 2
# threads, against per-expert bf16 casts: 1.28-1.41x faster at 32 rows per expert (256 experts of 512 x 512 and 256 x
# 512), 0.87-0.91x at 64 (128 x 512 x 512); the dropless top-2 layer of 256 experts 1.18x. Other CPUs: not measured,
# no such path.
FLOAT32_EXPERT_ROWS: dict[str, int] = {"AMX": 48}

# Under bf16 on a CPU, by its matrix units: a tokens-choice layer runs ragged groups as equal ones, zero-padded to the
# longest group (moekit.moe.padded_groups: the dispatch gathers into the buffer, batched matmuls, the combine gathers
# from it), where the padding adds at most this percentage to the rows. On a 2-core Xeon with AMX, an expert bank's
# forward + backward against the loop on the ragged rows: 8 experts of 64 -> 256 -> 64 1.39x faster at 2-15%
# padding, 1.19x at 35-41%; 128 -> 512 -> 128 and the MoE LM's SwiGLU 256 -> 512 1.11-1.14x at up to 16%, 0.95x at
# 40-43%; 64 SwiGLU experts of 128 rows 1.05-1.51x at up to 114%. Float32 (MKL there): 0.83-1.09x at up to 16%, so
# no entry for it. With the loop's workers taking the experts longest first the banks break even near 13% (the LM's),
# 20% (128 -> 512 -> 128) and 80% (64 -> 256 -> 64, 1.59x at 25%): 30 kept, for the narrow banks' sake.
PADDED_GROUPS_MAX_PERCENT: dict[str, int] = {"AMX": 30}
# The same for experts that drop out (training, dropout > 0): the padding's rows draw masks and pay the multiplies too,
# where the loop's cost is unchanged. The MoE LM's SwiGLU bank (256 -> 512 -> 256, dropout 0.1, 16,384 rows over 8
# experts, counts of one spread scaled) on the Xeon with AMX, padded against the loop: 76.2 / 81.2 ms at 6% padding,
# 78.8 / 80.4 at 12.5%, 86.9 / 78.7 at 25%, and at the benchmark's 19% 83.2-85.9 / 79.2-81.5; without dropout the same
# bank still gained at 12.5% (54.2 / 59.3) and lost at 25% (62.0 / 59.1). With the LM's experts dropping after the
# activation only, its whole step with 25 here: 1.29-1.34x the dense twin against 1.25-1.26x with 15 (two runs each).
# Once the loop's workers took the experts longest first the loop gained most on uneven counts: loop / padded 1.05x at
# 0%, 1.00-1.01x at 6%, 0.92-0.93x at 12%, 0.90x at 19% (the same bank with dropout), hence 5.
PADDED_GROUPS_MAX_PERCENT_DROPOUT: dict[str, int] = {"AMX": 5}

# Where ragged groups are not padded to equal ones, under bf16 on a CPU, by its matrix units: each expert's group is
# zero-padded up to a multiple of ROW_BLOCK where that adds at most this percentage to the rows (the same buffer,
# gathered by the dispatch and read by the combine), so that the loop runs one product per expert where it ran the
# bulk and the rest. oneDNN copies a product's weight into its own layout at every call, so the rest's product costs
# about what the bulk's does. On a 2-core Xeon with AMX, SwiGLU and GELU banks' forward + backward, padded against the
# ragged rows (bf16, 20 rounds in shuffled order): 0.82-0.97x the time at 1.3-34% padding (8-64 experts of 96-2,700
# rows), 0.90-0.94x at 51-54%, 1.105x at 103% (256 experts of 32 rows); with dropout 0.87-0.95x at 30-54%. Whole
# dropless top-2 layers (4096 tokens, 512 -> SwiGLU): 64 experts 0.88x (12 of 12 rounds faster), 256 experts 1.08x
# (not padded at 50); the MoE LM's and the width-128 top-2 ViT's layers 0.987x and 0.981x (~1.5% padding). With
# oneDNN held to avx512_bf16 there (a stand-in for bf16 CPUs without AMX): 0.99-1.02x at ~2,000 rows, 1.09-1.10x at
# 128 (+22-25%), so no entry for them.
BLOCK_PADDING_MAX_PERCENT: dict[str, int] = {"AMX": 50}

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


@torch.compiler.assume_constant_result  # a constant to torch.compile: a traced layer reads no file (no graph break)
def cpu_matrix_units() -> str:
    """The key of this CPU in the tables by matrix units: ``"AMX"`` (bf16 matrix units, the flag
    ``trainer.precision=auto`` reads), else ``""``."""
    return _cpu_matrix_units()


@functools.cache
def _cpu_matrix_units() -> str:
    return "AMX" if "amx_bf16" in cpu_flags() else ""


# The paths each named entry can take (the code's branches); entries of counts take positive ints.
_PATHS: dict[str, set[str]] = {
    "AUTO_KERNELS": {"loop", "bmm", "grouped_mm"},
    "CPU_FLOAT32_MATMUL": {"auto", "mkl", "onednn"},
    "LOOP_WEIGHT_CAST": {"bank", "expert"},
    "DISPATCH_GRADIENT": {"index_add", "gather"},
    "BASE_SOLVERS": {"exact", "sync_free"},
    "PATCHIFY_KERNELS": {"conv", "matmul"},
}
_ENTRIES = [name for name in __all__ if name.isupper()]
_SHIPPED = {name: copy.deepcopy(globals()[name]) for name in _ENTRIES}


def _key_text(key: Any) -> str:
    if isinstance(key, tuple):
        return ",".join(key)
    return str(key).removeprefix("torch.")


def _parse_key(name: str, text: str) -> Any:
    """``text`` as a key of the entry ``name``: a device type, ``device,layout`` or a dtype's name."""
    shipped = next(iter(_SHIPPED[name]))
    if isinstance(shipped, tuple):
        key = tuple(part.strip() for part in text.split(","))
        if len(key) != len(shipped):
            raise ValueError(f"{name}[{text}]: its keys are {len(shipped)} names, e.g. [{_key_text(shipped)}]")
        return key
    if isinstance(shipped, torch.dtype):
        dtype = getattr(torch, text.strip(), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}[{text}]: not a torch dtype; e.g. [float32], [bfloat16]")
        return dtype
    return text.strip()


def _parse_value(name: str, text: str, counts: bool) -> Any:
    text = text.strip()
    if counts:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{name}={text!r}: takes a positive int")
        return int(text)
    if name in _PATHS and text not in _PATHS[name]:
        raise ValueError(f"{name}={text!r}: not one of its paths; choose from {sorted(_PATHS[name])}")
    return text


def set_choice(spec: str) -> None:
    """Set an entry from ``NAME=VALUE``, or one key of a table entry from ``NAME[KEY]=VALUE`` (an empty VALUE removes
    the key: the code's default path). ``ROW_BLOCK=128``; ``AUTO_KERNELS[cpu,ragged]=grouped_mm``;
    ``PLANES_MIN_ROWS[float32]=64``; ``DISPATCH_GRADIENT[cpu]=`` (the default, a gather);
    ``COMBINE_PAIR_DEVICES=cpu,cuda`` or ``COMBINE_PAIR_DEVICES=`` (none). A bad name, key or value raises
    ``ValueError`` naming it and what the entry takes, and sets nothing."""
    target, sep, value = spec.partition("=")
    name, _, key = target.strip().partition("[")
    if not sep or name not in _ENTRIES or (key and not key.endswith("]")):
        raise ValueError(f"{spec!r}: expected NAME=VALUE or NAME[KEY]=VALUE with NAME one of {_ENTRIES}")
    shipped = _SHIPPED[name]
    if isinstance(shipped, int):
        if key:
            raise ValueError(f"{name} is one number: set it as {name}=VALUE")
        globals()[name] = _parse_value(name, value, counts=True)
    elif isinstance(shipped, str):
        if key:
            raise ValueError(f"{name} is one path: set it as {name}=VALUE, one of {sorted(_PATHS[name])}")
        globals()[name] = _parse_value(name, value, counts=False)
    elif isinstance(shipped, set):
        if key:
            what, example = (
                ("CPU families", "AMD family 26,AMD family 25") if "CPUS" in name else ("device types", "cpu,cuda")
            )
            raise ValueError(f"{name} is a set of {what}: set it as {name}={example} (or {name}= for none)")
        globals()[name] = {part.strip() for part in value.split(",") if part.strip()}
    elif not key:
        raise ValueError(
            f"{name} is a table: set one key as {name}[KEY]=VALUE, e.g. {name}[{_key_text(next(iter(shipped)))}]=..."
        )
    else:
        # a new table, not the old one changed: a module that imported the entry keeps the values it read
        table, parsed = dict(globals()[name]), _parse_key(name, key[:-1])
        if not value.strip():
            table.pop(parsed, None)
        else:
            path = _parse_value(name, value, counts=isinstance(next(iter(shipped.values())), int))
            if name == "AUTO_KERNELS" and parsed[1] == "ragged" and path == "bmm":
                raise ValueError(f"{spec!r}: bmm needs equal groups; ragged ones take loop or grouped_mm")
            table[parsed] = path
        globals()[name] = table


def changes() -> list[str]:
    """What differs from the table as shipped, as :func:`set_choice` specs that make it so (``[]``: as shipped)."""
    specs = []
    for name in _ENTRIES:
        now, shipped = globals()[name], _SHIPPED[name]
        if now == shipped:
            continue
        if isinstance(shipped, dict):
            specs += [f"{name}[{_key_text(k)}]={now[k]}" for k in now if shipped.get(k, None) != now[k]]
            specs += [f"{name}[{_key_text(k)}]=" for k in shipped if k not in now]
        elif isinstance(shipped, set):
            specs.append(f"{name}={','.join(sorted(now))}")
        else:
            specs.append(f"{name}={now}")
    return specs


def reset() -> None:
    """Every entry back to the table as shipped."""
    for name, shipped in _SHIPPED.items():
        if globals()[name] != shipped:
            globals()[name] = copy.deepcopy(shipped)


def describe() -> str:
    """``"as shipped"``, or the :func:`changes` (``"AUTO_KERNELS[cpu,ragged]=grouped_mm ROW_BLOCK=128"``)."""
    return " ".join(changes()) or "as shipped"


def add_choice_argument(parser) -> None:
    """Add ``--choice NAME=VALUE ...`` to an ``argparse`` parser (the benchmark scripts): entries of this table for the
    run, set by :func:`apply_choice_argument`."""
    parser.add_argument(
        "--choice",
        nargs="+",
        default=[],
        metavar="NAME=VALUE",
        help="set entries of moekit.moe.kernel_choices for this run (NAME[KEY]=VALUE for one key of a table), e.g. "
        "ROW_BLOCK=128 'AUTO_KERNELS[cpu,ragged]=grouped_mm'",
    )


def apply_choice_argument(parser, args) -> None:
    """Set each ``--choice``; a bad one ends the script with :func:`set_choice`'s message."""
    for spec in args.choice:
        try:
            set_choice(spec)
        except ValueError as error:
            parser.error(f"--choice {error}")
