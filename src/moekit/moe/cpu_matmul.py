"""Float32 products on CPUs through the faster of the two libraries torch ships: MKL or oneDNN.

torch runs a CPU's float32 ``mm`` / ``addmm`` / ``linear`` on MKL, whose kernels on AMD CPUs take a path that leaves
much of the FMA units idle: on a 2-core Zen 5 EPYC a 4096^3 product ran at 190 GFLOP/s on MKL against 415 on oneDNN,
which torch also ships (it runs bf16 products and convolutions), and a linear layer's forward + backward 1.3-2.1x
faster at widths of 64 to 8192. On a Zen 4 EPYC that exposes AVX-512 the gap is 1.09-1.22x; on Intel's CPUs MKL is
Intel's own library. The library is a property of the CPU, not of a run: ``kernel_choices.CPU_FLOAT32_MATMUL``
``"auto"`` takes oneDNN on the CPU families of ``kernel_choices.ONEDNN_FLOAT32_CPUS`` (measured there) and MKL
elsewhere, so that every process on one kind of machine sums its products in the same order (a seeded run, a
resumed one and DDP's ranks repeat bit for bit); ``"mkl"`` or ``"onednn"`` sets it. The layer benchmark's header
gives both libraries' rates on a machine (its matmul peak, :func:`moekit.analysis.peak.matmul_peak`), to tell whether
a CPU belongs in the table.

Where oneDNN is chosen, :class:`Linear` (every ``nn.Linear`` of moekit's models: :func:`adopt_linears`), the routers'
float32 logits (:func:`linear`) and the experts' grouped products (:mod:`moekit.moe.grouped_linear`) run their
forward and backward products on oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the operator Inductor's
CPU linear fusions call). Elsewhere, and under bf16 autocast, ``torch.compile`` or a ``TorchDispatchMode`` (the FLOP
counter sees only ATen's matmuls), the plain torch operators run. The values are the same products in float32, summed
in another order.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.utils.machine import cpu_family

from . import kernel_choices

__all__ = [
    "float32_library",
    "takes_onednn",
    "linear",
    "Linear",
    "adopt_linears",
    "matmul_into",
]

log = logging.getLogger("moekit")


def _onednn_op():
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


@functools.cache
def _this_cpu() -> str | None:
    return cpu_family()


@functools.cache
def _auto_choice(onednn_cpus: frozenset[str]) -> tuple[str, str]:
    """``"auto"``'s library on this machine under the table ``onednn_cpus``, and why; logged once per table."""
    family = _this_cpu()
    if _onednn_op() is None:
        library, why = "mkl", "this torch has no oneDNN matmul"
    elif family in onednn_cpus:
        library, why = "onednn", f"{family} is in kernel_choices.ONEDNN_FLOAT32_CPUS"
    else:
        library, why = "mkl", f"{family or 'this CPU'} is not in kernel_choices.ONEDNN_FLOAT32_CPUS"
    log.info("float32 CPU products: %s (%s)", "oneDNN" if library == "onednn" else "MKL", why)
    return library, why


def float32_library() -> tuple[str, str]:
    """``("onednn" | "mkl", why)``: the library of this process's float32 CPU products (see the module's
    docstring)."""
    setting = kernel_choices.CPU_FLOAT32_MATMUL
    if setting != "auto":
        return setting, "set by kernel_choices.CPU_FLOAT32_MATMUL"
    return _auto_choice(frozenset(kernel_choices.ONEDNN_FLOAT32_CPUS))


def takes_onednn(x: Tensor) -> bool:
    """Whether a product of ``x`` runs on oneDNN here: a plain float32 tensor on a CPU (not a subclass such as
    DTensor), outside autocast, ``torch.compile`` and dispatch modes, where :func:`float32_library` chose it."""
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
        and torch._C._len_torch_dispatch_stack() == 0
        and float32_library()[0] == "onednn"
    )


def _dense(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy where its layout has gaps (a slice of columns): oneDNN takes a matrix or its
    transpose as it lies, but runs a strided one on a reference kernel (a 128 x 512 x 1024 product, 1.6 s against
    0.9 ms)."""
    return t if t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous()) else t.contiguous()


def _onednn(a: Tensor, w_oi: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ w_oi.T (+ bias)`` on oneDNN: ``w_oi`` is ``[out, in]``, as a linear layer's weight."""
    return torch.ops.mkldnn._linear_pointwise(_dense(a), _dense(w_oi), bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """``F.linear`` with its three products on oneDNN: ``y = x W^T + b``, ``dx = dy W``, ``dW = dy^T x``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight = ctx.saved_tensors
        grad_TO = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad_TO, weight.t()).view(x.shape)  # [T, O] @ [O, I]
        if ctx.needs_input_grad[1]:
            grad_w = _onednn(grad_TO.t(), x.reshape(-1, x.shape[-1]).t())  # [O, T] @ [T, I]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_TO.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``, on oneDNN where :func:`takes_onednn` says so."""
    if weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype) and takes_onednn(x):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose float32 CPU products take the library :func:`float32_library` chose; the same parameters
    and state dict."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def adopt_linears(module: nn.Module) -> nn.Module:
    """Turn every plain ``nn.Linear`` in ``module`` (timm's blocks, heads, routers) into a :class:`Linear`, in place:
    a change of class only, so parameters, hooks and state dicts stay as they are. Returns ``module``."""
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = Linear
    return module


def matmul_into(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None = None, add: bool = False, onednn: bool = False):
    """``out = a @ b (+ bias)``, or ``out += a @ b`` with ``add``, for the experts' loop: on oneDNN (which writes a
    new tensor, copied into ``out``: a pass over the output, against the product's ``in`` multiply-adds per element)
    or torch's ``mm`` / ``addmm`` into ``out``."""
    if onednn:
        product = _onednn(a, b.t(), bias)
        out.add_(product) if add else out.copy_(product)
    elif add:
        out.addmm_(a, b)
    elif bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)
