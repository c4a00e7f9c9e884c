"""The experts' nonlinearity on ``fc1``'s output, and a gated one whose backward writes in ``fc1``'s layout.

A gated expert's ``fc1`` computes its gate and up projections as one product: ``h: [rows, 2 * hidden]`` (gate
columns, then up columns) from a batched matmul, or ``[2, rows, hidden]`` planes from the CPU loop
(:func:`moekit.moe.grouped_linear.grouped_linear`). ``act(gate) * up`` on views of ``h`` gives autograd two
gradients for the one tensor: it stacks them (a copy of the whole ``[2, rows, hidden]``) and, for the
``[rows, 2 * hidden]`` layout, copies the stack once more into ``h``'s strides. :class:`_GatedActivation` writes the
gate's and the up's gradients straight into one tensor of ``h``'s layout: the same values, bit for bit, without
those two copies (each a pass over twice the hidden rows; docs/performance.md, "The combine and the gated activation on
a CPU")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers.activations import GELU, GELUTanh
from torch import Tensor, nn

__all__ = ["expert_activation"]


def _gelu_mode(act: nn.Module) -> str | None:
    """``F.gelu``'s ``approximate`` of a GELU module (torch's or timm's), else None."""
    if isinstance(act, nn.GELU):
        return act.approximate
    return {GELU: "none", GELUTanh: "tanh"}.get(type(act))


def _fused_kind(act: nn.Module) -> str | None:
    """``"silu"``, ``"gelu:<approximate>"``, or None for an activation without an ATen backward kernel here."""
    if type(act) is nn.SiLU:
        return "silu"
    mode = _gelu_mode(act)
    return None if mode is None else f"gelu:{mode}"


def _split(h: Tensor, planes: bool) -> tuple[Tensor, Tensor]:
    """The gate and up views of ``h``: its planes, or its column halves."""
    return h.unbind(0) if planes else h.chunk(2, dim=-1)


class _GatedActivation(torch.autograd.Function):
    """``act(gate) * up`` of ``h``'s halves; the backward returns ``d h`` as one tensor laid out like ``h``."""

    @staticmethod
    def forward(ctx, h: Tensor, kind: str, planes: bool) -> Tensor:
        gate, up = _split(h, planes)
        a = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate=kind.split(":")[1])
        ctx.save_for_backward(gate, up, a)
        ctx.kind, ctx.planes, ctx.shape = kind, planes, h.shape
        # h's strides where it is dense: the batched matmul's planes are a transposed view of its [rows, 2 * hidden]
        ctx.stride = h.stride() if h.is_contiguous() or (planes and h.transpose(0, 1).is_contiguous()) else None
        return a * up

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up, a = ctx.saved_tensors
        grad_h = grad.new_empty(ctx.shape) if ctx.stride is None else grad.new_empty_strided(ctx.shape, ctx.stride)
        grad_gate, grad_up = _split(grad_h, ctx.planes)
        torch.mul(grad, a, out=grad_up)
        grad_a = grad * up
        if ctx.kind == "silu":
            torch.ops.aten.silu_backward.grad_input(grad_a, gate, grad_input=grad_gate)
        else:
            mode = ctx.kind.split(":")[1]
            torch.ops.aten.gelu_backward.grad_input(grad_a, gate, approximate=mode, grad_input=grad_gate)
        return grad_h, None, None


def expert_activation(h: Tensor, act: nn.Module, gated: bool, planes: bool = False) -> Tensor:
    """``act(h)``, or ``act(gate) * up`` for gated experts, whose ``h`` is ``[..., 2 * hidden]`` (gate, then up), or
    with ``planes`` ``[2, rows, hidden]``. A gated SiLU or GELU under autograd (not compiled: Inductor fuses the
    plain form) runs :class:`_GatedActivation`."""
    if not gated:
        return act(h)
    kind = _fused_kind(act)
    if kind is not None and h.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _GatedActivation.apply(h, kind, planes)
    gate, up = _split(h, planes)
    return act(gate) * up
