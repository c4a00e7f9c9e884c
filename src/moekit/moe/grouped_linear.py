"""Per-expert affine maps of rows sorted by expert: the kernels an :class:`~moekit.moe.ExpertBank` runs.

``"loop"`` - one BLAS call per expert, written into preallocated outputs (ragged counts are read on the host: a
sync, free on CPU; under ``torch.compile`` a custom operator, opaque to it, so no graph break; on CPUs with many
experts the calls are spread over the cores, :mod:`moekit.moe.cpu_threads`); ``"bmm"`` - one
batched matmul (equal groups only); ``"grouped_mm"`` - ``torch._grouped_mm`` with device-side offsets (no host sync;
feature sizes that are not 16-byte multiples are zero-padded to one). ``"auto"`` picks per device and layout
(``AUTO_KERNELS`` of :mod:`moekit.moe.kernel_choices`, the table of every such choice). ``planes=2`` hands a gated
expert's gate and up back as two planes, contiguous from the CPU loop where groups are large (``PLANES_MIN_ROWS``).
Under bf16 autocast the CPU loop casts float32 weights expert by expert as their products run (experts of few rows then
run in float32 on CPUs with AMX, ``FLOAT32_EXPERT_ROWS``), or takes the whole bank cast first (``LOOP_WEIGHT_CAST``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from . import kernel_choices
from .cpu_matmul import float32_library, matmul_into, takes_onednn
from .cpu_threads import for_each_expert

__all__ = ["grouped_linear", "reads_counts_on_host", "Kernel", "GroupSizes"]

Kernel = Literal["auto", "loop", "bmm", "grouped_mm"]
GroupSizes = int | Tensor

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _grouped_mm_takes(dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` runs bf16 and float32 eagerly; under ``torch.compile`` its meta function takes bf16 only
    (float32: "Expected mat_a to be BFloat16")."""
    return _HAS_GROUPED_MM and (
        dtype == torch.bfloat16 or (dtype == torch.float32 and not torch.compiler.is_compiling())
    )


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


def _loop_forward(x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int) -> Tensor:
    """Rows of expert ``e`` times ``weight[e]`` (plus ``bias[e]``), in ``x``'s dtype: ``[rows, out]``, or for
    ``planes`` > 1 ``[planes, rows, out / planes]``, plane ``p`` holding output columns ``p * out / planes`` onwards,
    contiguous, one product per expert and plane. Weights of another dtype (float32 parameters for bf16 activations)
    are cast expert by expert as each product runs: a cast tile in the cache, where casting the whole bank first reads
    and writes it once more in memory; an expert of fewer rows than :func:`_float32_rows` runs in float32 instead."""
    sizes = counts.tolist()  # the host sync the loop needs (free on CPU)
    rows = sum(sizes)
    dtype = x.dtype
    width = weight.shape[-1] // planes
    out = x.new_empty(planes, x.shape[0], width)
    onednn = takes_onednn(x)  # here, before the worker threads
    float32_rows, onednn32 = _float32_rows(x, weight)
    block_sizes, blocks = _row_blocks(sizes, x, onednn)
    x_parts = x[:rows].split(block_sizes)
    out_parts = [plane[:rows].split(block_sizes) for plane in out]
    w_parts = [w.unbind(0) for w in weight.split(width, dim=-1)]
    b_parts = None if bias is None else [b.unbind(0) for b in bias.split(width, dim=-1)]

    def work(e: int) -> None:
        for p in range(planes):
            if sizes[e] < float32_rows:
                b = None if b_parts is None else b_parts[p][e]
                for i in blocks[e]:
                    out_parts[p][i].copy_(_float32_product(x_parts[i], w_parts[p][e], b, onednn32))
                continue
            w = w_parts[p][e].to(dtype)
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
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`_loop_forward` (an empty tensor for each one not needed), each in its input's
    dtype: the products run in ``x``'s (in float32 for an expert of few rows, :func:`_float32_rows`), and a weight
    gradient of another dtype is cast expert by expert. One pass
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

        def input_grad(e: int) -> None:
            if sizes[e] < float32_rows:
                for i in blocks[e]:
                    gx = _float32_product(g_parts[0][i], w_t[0][e], onednn=onednn32)
                    for p in range(1, planes):
                        matmul_into(gx, g_parts[p][i].float(), w_t[p][e], add=True, onednn=onednn32)
                    gx_parts[i].copy_(gx)
                return
            for p in range(planes):
                w = w_t[p][e].to(dtype)
                for i in blocks[e]:
                    matmul_into(gx_parts[i], g_parts[p][i], w, add=p > 0, onednn=onednn)

        steps.append(input_grad)
        if rows < x.shape[0]:
            grad_x[rows:].zero_()
    if need_w:
        grad_w = torch.empty_like(weight)
        x_t, gw_parts = x[:rows].t().split(block_sizes, dim=1), [gw.unbind(0) for gw in grad_w.split(width, dim=-1)]
        for e in (e for e, size in enumerate(sizes) if not size):
            grad_w[e].zero_()
        cast = weight.dtype != dtype

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
        grad_b = weight.new_zeros(weight.shape[0], weight.shape[-1])
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
_loop_op = torch.library.custom_op("moekit::grouped_linear_loop", _loop_forward, mutates_args=())
_loop_backward_op = torch.library.custom_op("moekit::grouped_linear_loop_backward", _loop_backward, mutates_args=())


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
    (``torch.utils.flop_counter``), which sees a custom operator as one op of unknown cost."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int) -> Tensor:
        _setup_context(ctx, (x, weight, bias, counts, planes), None)
        return _loop_forward(x, weight, bias, counts, planes)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return _backward(ctx, grad_out, op=_loop_backward)


def _loop(x: Tensor, weight: Tensor, bias: Tensor | None, counts: Tensor, planes: int) -> Tensor:
    """The loop kernel: the custom operator under ``torch.compile``, the autograd function otherwise."""
    if torch.compiler.is_compiling():
        return _loop_op(x, weight, bias, counts, planes)
    return _LoopGroupedLinear.apply(x, weight, bias, counts, planes)


class _AddGroupBias(torch.autograd.Function):
    """``out + bias[expert_of_row]``, whose bias gradient sums each expert's rows of the output gradient with one
    grouped product of a block of ones (``[8, rows] @ [rows, out]`` per group of rows): summed in the matmul's float32
    accumulator and in a fixed order, where ``index_select``'s gradient, ``index_add_``, adds every row into its
    expert's one row atomically on GPUs (a different order in every run, in the gradient's own dtype)."""

    @staticmethod
    def forward(ctx, out: Tensor, bias: Tensor, expert_of_row: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(offs)
        return out + bias.index_select(0, expert_of_row)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (offs,) = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        ones = grad_out.new_ones(grad_out.shape[0], 8).t()  # [8, rows], column-major: 16-byte strides in bf16
        grad_bias = torch._grouped_mm(ones, grad_out, offs=offs)[:, 0]  # [experts, 8, out] -> [experts, out]
        return grad_out, grad_bias, None, None


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: ``torch._grouped_mm``'s CPU backward fails on the
    stride-0 gradient that ``out.sum()`` sends back ("Invalid strides/sizes")."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _resolve_kernel(kernel: str, x: Tensor, equal_groups: bool) -> str:
    if kernel == "auto":
        kernel = kernel_choices.AUTO_KERNELS.get((x.device.type, "equal" if equal_groups else "ragged"), "loop")
        if kernel == "grouped_mm" and not _grouped_mm_takes(x.dtype):
            kernel = "bmm" if equal_groups else "loop"
        if kernel == "bmm" and takes_onednn(x):  # oneDNN's per-expert products beat MKL's batched one
            kernel = "loop"
    if kernel == "bmm" and not equal_groups:
        raise ValueError("kernel='bmm' needs equal rows per expert (capacity buffers); use 'loop' or 'grouped_mm'")
    if kernel == "grouped_mm" and not _HAS_GROUPED_MM:
        raise ValueError(f"kernel='grouped_mm' needs torch._grouped_mm, which torch {torch.__version__} lacks; use "
                         "kernel='loop' or 'auto'")  # fmt: skip
    return kernel


def reads_counts_on_host(kernel: str, x: Tensor) -> bool:
    """Whether ragged groups of rows like ``x`` run on the CPU loop under ``kernel``, which reads their counts on the
    host (free on a CPU)."""
    return x.device.type == "cpu" and kernel != "bmm" and _resolve_kernel(kernel, x, equal_groups=False) == "loop"


def _aligned_operands(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, int]:
    """``torch._grouped_mm`` needs rows of 16-byte multiples: zero-pad the in and out features up to one (the
    padded products are zero and their gradients are cut away). Returns the operands and the true out size."""
    step = 16 // x.element_size()
    pad_in, pad_out = -weight.shape[1] % step, -weight.shape[2] % step
    if pad_in:
        x = torch.nn.functional.pad(x, (0, pad_in))
    if pad_in or pad_out:
        weight = torch.nn.functional.pad(weight, (0, pad_out, 0, pad_in))
    return x, weight, weight.shape[2] - pad_out


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
            products run in ``x``'s. On a CPU the loop casts each expert's weights as it runs its product, or the
            whole bank first where ``LOOP_WEIGHT_CAST`` says so; the other kernels, and the loop on other devices,
            cast the whole bank first.
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
    if weight.dtype != x.dtype and not (kernel == "loop" and _casts_per_expert(x)):
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
        out = _grouped_mm_kernel(x, weight, bias, group_sizes, no_tail)
    return out if planes == 1 else out.unflatten(-1, (planes, -1)).transpose(0, 1)


def _grouped_mm_kernel(x: Tensor, weight: Tensor, bias: Tensor | None, group_sizes: GroupSizes, no_tail: bool):
    """``torch._grouped_mm`` with device-side offsets: no host sync."""
    num_experts = weight.shape[0]
    equal = isinstance(group_sizes, int)
    if equal:
        counts = torch.full((num_experts,), group_sizes, device=x.device, dtype=torch.int64)
    else:
        counts = group_sizes
    offsets = counts.cumsum(0)
    mask_tail = not (equal or no_tail)  # rows past the last group: grouped_mm leaves them unset
    row = torch.arange(x.shape[0], device=x.device) if mask_tail or bias is not None else None
    if mask_tail:
        valid = (row < offsets[-1]).unsqueeze(-1)
        x = torch.where(valid, x, x.new_zeros(()))
    x, padded_weight, out_features = _aligned_operands(x, weight)
    offs = offsets.to(torch.int32)
    out = torch._grouped_mm(x, padded_weight, offs=offs)
    if bias is not None:  # on the padded width: its rows are 16-byte multiples, as the bias gradient's product needs
        expert_of_row = torch.searchsorted(offsets, row, right=True).clamp_(max=num_experts - 1)
        out = _AddGroupBias.apply(
            out, torch.nn.functional.pad(bias, (0, out.shape[-1] - out_features)), expert_of_row, offs
        )
    if out.shape[-1] != out_features:
        out = out[:, :out_features]
    if not mask_tail and x.device.type == "cpu":  # masked outputs pass torch.where below, whose gradient is dense
        out = _DenseGrad.apply(out)
    if mask_tail:
        out = torch.where(valid, out, out.new_zeros(()))
    return out
