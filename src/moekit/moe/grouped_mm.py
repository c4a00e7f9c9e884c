"""The ``"grouped_mm"`` kernel of :func:`moekit.moe.grouped_linear.grouped_linear`: ``torch._grouped_mm`` with
device-side offsets, no host sync (GPUs' choice for ragged groups: ``AUTO_KERNELS`` of
:mod:`moekit.moe.kernel_choices`). Feature sizes that are not 16-byte multiples are zero-padded to one; biased experts
sum each expert's bias gradient in one grouped product, in a fixed order."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HAS_GROUPED_MM", "grouped_mm_takes", "grouped_mm_kernel"]

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_mm_takes(dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` runs bf16 and float32 eagerly; under ``torch.compile`` its meta function takes bf16 only
    (float32: "Expected mat_a to be BFloat16")."""
    return HAS_GROUPED_MM and (
        dtype == torch.bfloat16 or (dtype == torch.float32 and not torch.compiler.is_compiling())
    )


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


def grouped_mm_kernel(x: Tensor, weight: Tensor, bias: Tensor | None, group_sizes: int | Tensor, no_tail: bool):
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
