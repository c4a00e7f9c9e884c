"""Per-expert affine maps of rows sorted by expert: the kernels an :class:`~moekit.moe.ExpertBank` runs.

``"loop"`` - one BLAS call per expert, written into preallocated outputs (ragged counts are read on the host: a
sync, free on CPU; under ``torch.compile`` a custom operator, opaque to it, so no graph break; on CPUs with many
experts the calls are spread over the cores, :mod:`moekit.moe.cpu_threads`); ``"bmm"`` - one
batched matmul (equal groups only); ``"grouped_mm"`` - ``torch._grouped_mm`` with device-side offsets (no host sync;
feature sizes that are not 16-byte multiples are zero-padded to one). ``"auto"`` picks per device and layout
(``AUTO_KERNELS`` of :mod:`moekit.moe.kernel_choices`, the table of every such choice). ``planes=2`` hands a gated
expert's gate and up back as two planes, contiguous from the CPU loop where groups are large (``PLANES_MIN_ROWS``).
Under bf16 autocast the CPU loop casts float32 weights expert by expert as their products run, and again for the
backward (experts of few rows then run in float32 on CPUs with AMX, ``FLOAT32_EXPERT_ROWS``), or casts them once
(``LOOP_WEIGHT_CAST``): in eager mode each expert's as its product runs, into a copy kept for the backward, which
writes the weight gradients in float32 expert by expert; under ``torch.compile`` the whole bank before the loop.
The ``"grouped_mm"`` kernel lives in :mod:`moekit.moe.grouped_mm`.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor

from . import kernel_choices
from .cpu_matmul import float32_library, matmul_into, takes_onednn
from .cpu_threads import for_each_expert
from .grouped_mm import HAS_GROUPED_MM, grouped_mm_kernel, grouped_mm_takes

__all__ = ["grouped_linear", "reads_counts_on_host", "Kernel", "GroupSizes"]

Kernel = Literal["auto", "loop", "bmm", "grouped_mm"]
GroupSizes = int | Tensor


def _row_blocks(sizes: list[int], x: Tensor, onednn: bool) -> tuple[list[int], list[range]]:
    """The blocks of rows the products run on, each expert's rows all at once or, where oneDNN runs them (a CPU in
    bf16 / float16, or float32 where :mod:`moekit.moe.cpu_matmul` chose it), a multiple of ``kernel_choices.ROW_BLOCK``
    (``FLOAT32_ROW_BLOCK``) and the rest (see there): the block sizes in row order, and the range of its blocks'
    indices per expert. One ``split`` by these sizes gives every block's view (slicing per expert and block in Python
    cost as much as a small product)."""
    if x.device.type != "cpu" or not (onednn or x.dtype in (torch.bfloat16, torch.float16)):
        return sizes, [range(e, e + 1) for e in range(len(sizes))]
    block_sizes, blocks = [], []
    row_block = kernel_choices.FLOAT32_ROW_BLOCK if x.dtype == torch.float32 else kernel_choices.ROW_BLOCK
    for n in sizes:
        bulk = n - n % row_block
        blocks.append(range(len(block_sizes), len(block_sizes) + (2 if 0 < bulk < n else 1)))
        block_sizes += [bulk, n - bulk] if 0 < bulk < n else [n]
    return block_sizes, blocks


def _casts_per_expert(x: Tensor) -> bool:
    """Whether the loop casts weights of another dtype expert by expert as it runs their products
    (``LOOP_WEIGHT_CAST``: a CPU whose entry is not ``"bank"``), rather than taking the whole bank cast first."""
    if x.device.type != "cpu":
        return False
    return kernel_choices.LOOP_WEIGHT_CAST.get(kernel_choices.cpu_matrix_units(), "expert") == "expert"


def _keeps_cast(x: Tensor) -> bool:
    """Whether the loop casts a bank of another dtype once, for the forward and the backward (``LOOP_WEIGHT_CAST``
    ``"bank"``), itself: in eager mode on a CPU, expert by expert as their products run (:class:`_LoopGroupedLinear`);
    elsewhere :func:`grouped_linear` casts the whole bank before the loop."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and not _casts_per_expert(x)


def _float32_rows(x: Tensor, weight: Tensor) -> tuple[int, bool]:
    """Rows below which an expert's products run in float32 on its float32 weights, bf16 rows cast up
    (``FLOAT32_EXPERT_ROWS``; 0: none), and whether those products run on oneDNN."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        return 0, False
    rows = kernel_choices.FLOAT32_EXPERT_ROWS.get(kernel_choices.cpu_matrix_units(), 0)
    return rows, rows > 0 and float32_library()[0] == "onednn"


def _float32_product(a: Tensor, b: Tensor, bias: Tensor | None = None, onednn: bool = False) -> Tensor:
    """``a @ b (+ bias)`` in float32, ``a`` cast up: a product of few rows on float32 weights, read once."""
    out = a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)
    matmul_into(out, a.float(), b, bias, onednn=onednn)
    return out


def _loop_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int, cast_into: Tensor | None = None
) -> Tensor:
    """Rows of expert ``e`` times ``weight[e]`` (plus ``bias[e]``), in ``x``'s dtype: ``[rows, out]``, or for
    ``planes`` > 1 ``[planes, rows, out / planes]``, plane ``p`` holding output columns ``p * out / planes`` onwards,
    contiguous, one product per expert and plane. Weights of another dtype (float32 parameters for bf16 activations)
    are cast expert by expert as each product runs: a cast tile in the cache, where casting the whole bank first reads
    and writes it once more in memory; an expert of fewer rows than :func:`_float32_rows` runs in float32 instead.
    ``cast_into`` (``weight``'s shape in ``x``'s dtype): each expert's cast is written there, kept for the backward
    (every expert's products then in ``x``'s dtype)."""
    sizes = counts.tolist()  # the host sync the loop needs (free on CPU)
    rows = sum(sizes)
    dtype = x.dtype
    width = weight.shape[-1] // planes
    out = x.new_empty(planes, x.shape[0], width)
    onednn = takes_onednn(x)  # here, before the worker threads
    float32_rows, onednn32 = _float32_rows(x, weight) if cast_into is None else (0, False)
    block_sizes, blocks = _row_blocks(sizes, x, onednn)
    x_parts = x[:rows].split(block_sizes)
    out_parts = [plane[:rows].split(block_sizes) for plane in out]
    w_parts = [w.unbind(0) for w in weight.split(width, dim=-1)]
    kept = None if cast_into is None else [w.unbind(0) for w in cast_into.split(width, dim=-1)]
    b_parts = None if bias is None else [b.unbind(0) for b in bias.split(width, dim=-1)]
    same = weight.dtype == dtype  # no cast: a no-op .to() per expert cost ~2% of 256 products of 32 rows

    def work(e: int) -> None:
        for p in range(planes):
            if sizes[e] < float32_rows:
                b = None if b_parts is None else b_parts[p][e]
                for i in blocks[e]:
                    out_parts[p][i].copy_(_float32_product(x_parts[i], w_parts[p][e], b, onednn32))
                continue
            if same:
                w, b = w_parts[p][e], None if b_parts is None else b_parts[p][e]
            else:
                w = w_parts[p][e].to(dtype) if kept is None else kept[p][e].copy_(w_parts[p][e])
                b = None if b_parts is None else b_parts[p][e].to(dtype)
            for i in blocks[e]:
                matmul_into(out_parts[p][i], x_parts[i], w, b, onednn=onednn)

    for_each_expert(work, sizes, x.device, x.dtype)
    if rows < x.shape[0]:
        out[:, rows:].zero_()
    return out if planes > 1 else out[0]


def _loop_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    counts: Tensor,
    planes: int,
    need_x: bool,
    need_w: bool,
    need_b: bool,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`_loop_forward` (an empty tensor for each one not needed), each in its input's
    dtype (the weight's and bias's in ``grad_dtype`` where given: the parameters' of a kept cast): the products run in
    ``x``'s (in float32 for an expert of few rows, :func:`_float32_rows`), and a weight gradient of another dtype is
    written expert by expert. One pass
    over the experts computes all of an expert's gradients while its rows of ``grad_out`` are in the cache, with one
    wait for the threads (docs/performance.md, "Expert products over the CPU's threads"). The input gradient of
    several planes adds one product per plane into the first's (in bf16, rounded once per plane)."""
    sizes = counts.tolist()
    rows = sum(sizes)
    dtype = x.dtype
    width = weight.shape[-1] // planes
    grad_out = grad_out.contiguous() if planes > 1 else grad_out.contiguous().unsqueeze(0)
    onednn = takes_onednn(x)
    float32_rows, onednn32 = _float32_rows(x, weight)
    block_sizes, blocks = _row_blocks(sizes, x, onednn)
    g_parts = [plane[:rows].split(block_sizes) for plane in grad_out]
    grad_x = grad_w = grad_b = x.new_empty(0)
    steps = []
    if need_x:
        grad_x = torch.empty_like(x)
        gx_parts = grad_x[:rows].split(block_sizes)
        w_t = [w.transpose(1, 2).unbind(0) for w in weight.split(width, dim=-1)]
        same = weight.dtype == dtype

        def input_grad(e: int) -> None:
            if sizes[e] < float32_rows:
                for i in blocks[e]:
                    gx = _float32_product(g_parts[0][i], w_t[0][e], onednn=onednn32)
                    for p in range(1, planes):
                        matmul_into(gx, g_parts[p][i].float(), w_t[p][e], add=True, onednn=onednn32)
                    gx_parts[i].copy_(gx)
                return
            for p in range(planes):
                w = w_t[p][e] if same else w_t[p][e].to(dtype)
                for i in blocks[e]:
                    matmul_into(gx_parts[i], g_parts[p][i], w, add=p > 0, onednn=onednn)

        steps.append(input_grad)
        if rows < x.shape[0]:
            grad_x[rows:].zero_()
    if need_w:
        grad_w = torch.empty_like(weight, dtype=grad_dtype)
        x_t, gw_parts = x[:rows].t().split(block_sizes, dim=1), [gw.unbind(0) for gw in grad_w.split(width, dim=-1)]
        for e in (e for e, size in enumerate(sizes) if not size):
            grad_w[e].zero_()
        cast = grad_w.dtype != dtype

        def weight_grad(e: int) -> None:  # a sum over the rows: the blocks' products add up, in the rows' dtype
            for p in range(planes):
                gw = gw_parts[p][e]
                first, *rest = blocks[e]
                if sizes[e] < float32_rows:  # float32 rows: the sum lands in the float32 gradient
                    for i in blocks[e]:
                        matmul_into(gw, x_t[i].float(), g_parts[p][i].float(), add=i != first, onednn=onednn32)
                    continue
                if cast:
                    acc = torch.mm(x_t[first], g_parts[p][first])
                else:
                    acc = gw
                    matmul_into(gw, x_t[first], g_parts[p][first], onednn=onednn)
                for i in rest:
                    matmul_into(acc, x_t[i], g_parts[p][i], add=True, onednn=onednn)
                if cast:  # once: a pass over a float32 gradient per block cost more than the blocks saved
                    gw.copy_(acc)

        steps.append(weight_grad)
    if need_b:
        grad_b = weight.new_zeros(weight.shape[0], weight.shape[-1], dtype=grad_dtype)
        gb_parts = [gb.unbind(0) for gb in grad_b.split(width, dim=-1)]
        whole = len(block_sizes) == len(sizes)  # one block per expert: the blocks are the experts' rows
        g_rows = g_parts if whole else [plane[:rows].split(sizes) for plane in grad_out]

        def bias_grad(e: int) -> None:  # in the rows' dtype (float32 accumulation inside), rounded once, as the
            # batched kernel's and torch's Linear's under autocast: sum(dtype=float32) casts all the rows first
            for p in range(planes):
                gb_parts[p][e].copy_(g_rows[p][e].sum(dim=0))

        steps.append(bias_grad)

    def work(e: int) -> None:
        for step in steps:
            step(e)

    if steps:
        for_each_expert(work, sizes, x.device, x.dtype)
    return grad_x, grad_w, grad_b


# The loop as custom operators: torch.compile treats them as opaque kernels of known output shape, so the host read
# of the counts inside them breaks no graph. Outputs and gradients are written into preallocated tensors: no
# per-expert autograd nodes and no zero-filled full-size gradient per expert (which ``weight[e]`` indexing in a
# Python loop costs); the per-expert views come from one ``split`` / ``unbind`` each, to keep Python overhead low.
def _op_forward(x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int) -> Tensor:
    """The custom operator's loop: no kept cast (under ``torch.compile`` a bank of another dtype is cast first)."""
    return _loop_forward(x, weight, bias, counts, planes)


def _op_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, counts: Tensor, planes: int, need_x: bool, need_w: bool, need_b: bool
) -> tuple[Tensor, Tensor, Tensor]:
    return _loop_backward(grad_out, x, weight, counts, planes, need_x, need_w, need_b)


_loop_op = torch.library.custom_op("moekit::grouped_linear_loop", _op_forward, mutates_args=())
_loop_backward_op = torch.library.custom_op("moekit::grouped_linear_loop_backward", _op_backward, mutates_args=())


@_loop_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int) -> Tensor:
    if planes == 1:
        return x.new_empty(x.shape[0], weight.shape[-1])
    return x.new_empty(planes, x.shape[0], weight.shape[-1] // planes)


@_loop_backward_op.register_fake
def _(grad_out, x, weight, counts, planes, need_x, need_w, need_b):
    empty = x.new_empty(0)
    return (
        torch.empty_like(x) if need_x else empty,
        torch.empty_like(weight) if need_w else empty,
        weight.new_empty(weight.shape[0], weight.shape[-1]) if need_b else empty,
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, counts, planes = inputs
    ctx.save_for_backward(x, weight, counts)
    ctx.has_bias, ctx.planes = bias is not None, planes


def _backward(ctx, grad_out: Tensor, op=_loop_backward_op):
    x, weight, counts = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and ctx.has_bias
    grad_x, grad_w, grad_b = op(grad_out, x, weight, counts, ctx.planes, need_x, need_w, need_b)
    return (grad_x if need_x else None, grad_w if need_w else None, grad_b if need_b else None, None, None)


_loop_op.register_autograd(_backward, setup_context=_setup_context)


class _LoopGroupedLinear(torch.autograd.Function):
    """The loop in eager mode: the same kernels, with their ``torch.mm`` calls visible to the FLOP counter
    (``torch.utils.flop_counter``), which sees a custom operator as one op of unknown cost. Where the bank casts once
    (:func:`_keeps_cast`), each expert's weights are cast as its product runs into a copy kept for the backward, whose
    weight and bias gradients come back in the parameters' dtype, expert by expert: no pass over the whole bank before
    the products, nor over its gradient after them (docs/performance.md, "bf16 autocast on a CPU")."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int) -> Tensor:
        cast = torch.empty_like(weight, dtype=x.dtype) if weight.dtype != x.dtype and _keeps_cast(x) else None
        out = _loop_forward(x, weight, bias, counts, planes, cast_into=cast)
        _setup_context(ctx, (x, weight if cast is None else cast, bias, counts, planes), None)
        ctx.grad_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return _backward(ctx, grad_out, op=functools.partial(_loop_backward, grad_dtype=ctx.grad_dtype))


def _loop(x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int) -> Tensor:
    """The loop kernel: the custom operator under ``torch.compile``, the autograd function otherwise."""
    if torch.compiler.is_compiling():
        return _loop_op(x, weight, bias, counts, planes)
    return _LoopGroupedLinear.apply(x, weight, bias, counts, planes)


def _resolve_kernel(kernel: str, x: Tensor, equal_groups: bool) -> str:
    if kernel == "auto":
        kernel = kernel_choices.AUTO_KERNELS.get((x.device.type, "equal" if equal_groups else "ragged"), "loop")
        if kernel == "grouped_mm" and not grouped_mm_takes(x.dtype):
            kernel = "bmm" if equal_groups else "loop"
        if kernel == "bmm" and takes_onednn(x):  # oneDNN's per-expert products beat MKL's batched one
            kernel = "loop"
    if kernel == "bmm" and not equal_groups:
        raise ValueError("kernel='bmm' needs equal rows per expert (capacity buffers); use 'loop' or 'grouped_mm'")
    if kernel == "grouped_mm" and not HAS_GROUPED_MM:
        raise ValueError(f"kernel='grouped_mm' needs torch._grouped_mm, which torch {torch.__version__} lacks; use "
                         "kernel='loop' or 'auto'")  # fmt: skip
    return kernel


def reads_counts_on_host(kernel: str, x: Tensor) -> bool:
    """Whether ragged groups of rows like ``x`` run on the CPU loop under ``kernel``, which reads their counts on the
    host (free on a CPU)."""
    return x.device.type == "cpu" and kernel != "bmm" and _resolve_kernel(kernel, x, equal_groups=False) == "loop"


def grouped_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    group_sizes: GroupSizes,
    kernel: str = "auto",
    no_tail: bool = False,
    planes: int = 1,
) -> Tensor:
    """Per-expert affine map of rows sorted by expert.

    Args:
        x: ``[rows, in]``, the rows of expert 0 first, then expert 1, ...
        weight: ``[experts, in, out]``, in ``x``'s dtype or another (float32 parameters for bf16 activations): the
            products run in ``x``'s. On a CPU the loop casts each expert's weights as it runs its product (again in
            the backward, or once into a copy the backward reads where ``LOOP_WEIGHT_CAST`` says ``"bank"``; under
            ``torch.compile`` that bank is cast first); the other kernels, and the loop on other devices, cast the
            whole bank first.
        bias: ``[experts, out]`` or None, in ``weight``'s dtype.
        group_sizes: ``int`` rows per expert (all equal) or ``LongTensor [experts]`` counts.
        kernel: ``"auto" | "loop" | "bmm" | "grouped_mm"``.
        no_tail: the counts sum to ``rows`` (a dropless dispatch): the ``grouped_mm`` kernel then skips the two
            full-size masks that zero the outputs and gradients of rows past the last group (on an H100, 22% of
            a top-2 layer's GPU time with 64 experts). Wrong if a tail exists: its rows come back unset.
        planes: the output as ``[planes, rows, out / planes]``, plane ``p`` holding columns ``p * out / planes``
            onwards (a gated expert's gate and up). The CPU loop writes each plane contiguous, a product per plane,
            where experts average ``kernel_choices.PLANES_MIN_ROWS`` rows or more (per dtype); elsewhere the planes are
            views of one output.

    Returns:
        ``[rows, out]`` (``[planes, rows, out / planes]``); rows after the last group are zeros.
    """
    if planes < 1 or weight.shape[-1] % planes:
        raise ValueError(f"planes={planes} must be a positive divisor of the {weight.shape[-1]} output features")
    num_experts = weight.shape[0]
    equal = isinstance(group_sizes, int)
    kernel = _resolve_kernel(kernel, x, equal)
    if weight.dtype != x.dtype and not (kernel == "loop" and (_casts_per_expert(x) or _keeps_cast(x))):
        weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
    if kernel == "bmm":
        xb = x.view(num_experts, group_sizes, x.shape[-1])
        out = torch.bmm(xb, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), xb, weight)
        out = out.view(x.shape[0], weight.shape[-1])
    elif kernel == "loop":
        counts = torch.full((num_experts,), group_sizes, dtype=torch.long) if equal else group_sizes
        table = kernel_choices.PLANES_MIN_ROWS  # other dtypes take bf16's; no entry: views of one output
        min_rows = table.get(x.dtype, table.get(torch.bfloat16))
        large = min_rows is not None and x.shape[0] >= min_rows * num_experts
        if planes > 1 and large and x.device.type == "cpu" and not takes_onednn(x):  # oneDNN: one product, views
            return _loop(x, weight, bias, counts, planes)
        out = _loop(x, weight, bias, counts, 1)
    else:
        out = grouped_mm_kernel(x, weight, bias, group_sizes, no_tail)
    return out if planes == 1 else out.unflatten(-1, (planes, -1)).transpose(0, 1)
