"""The layer benchmark's ``products`` table: what bounds the expert products of its layers on this machine.

Each product of the ``soft`` and ``topk`` tables' layers (their experts' ``fc1`` and ``fc2``, with the rows per expert
those layers give them) runs forward + backward three ways, in interleaved rounds:

* **own weights** - every expert its own weight, as in the layer: the kernel the layer runs (``grouped_linear`` with
  ``kernel="auto"``: ragged counts for the tokens-choice layers, equal groups for Soft MoE's slots);
* **one weight for all** - the same kernel on the same rows, every expert's weight one tensor (a bank whose experts
  share storage, held in the compute dtype), so that after the first expert the weight comes from the cache rather
  than from memory; the weight gradients are written per expert, as above;
* **one dense product** - all the rows times one weight in one matmul, the rate the machine's matmuls reach at this
  width (the dense layers' rate).

``own / one weight`` is then what reading each expert's weight from memory costs, ``one weight / dense`` what splitting
the rows into short products costs (docs/performance.md, "What bounds many small experts on a CPU"). The FLOPs of each
are ``3 x 2 x rows x in x out`` (the forward, the input gradient and the weight gradient).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from moekit.analysis.layer_timing import Candidate, time_candidates
from moekit.moe.cpu_matmul import linear
from moekit.moe.experts import compute_dtype
from moekit.moe.grouped_linear import grouped_linear

__all__ = ["SOFT_SHAPES", "TOPK_SHAPES", "Product", "layer_products", "table_products"]

# The soft and topk tables' layers, full and --quick: Soft MoE (batch, tokens, dim, hidden, slots; expert counts),
# tokens-choice top-2 (tokens, dim; (experts, hidden) pairs).
SOFT_SHAPES = {False: ((32, 196, 384, 1536, 128), (8, 32, 128)), True: ((4, 49, 64, 256, 16), (4, 16))}
TOPK_SHAPES = {False: ((4096, 512), ((64, 2048), (256, 256))), True: ((512, 64), ((8, 128), (32, 32)))}


@dataclass(frozen=True)
class Product:
    """One expert product of a layer: ``experts`` groups of ``rows`` rows, ``in_features -> out_features``;
    ``ragged``: the layer hands its kernel counts (tokens-choice), else equal groups (Soft MoE's slots)."""

    label: str
    experts: int
    rows: int
    in_features: int
    out_features: int
    ragged: bool

    @property
    def flops(self) -> int:
        return 3 * 2 * self.experts * self.rows * self.in_features * self.out_features


def layer_products(quick: bool = False, batch_scale: int = 1) -> list[Product]:
    """The expert products of the ``soft`` and ``topk`` tables' layers (a gated expert's gate and up as one
    product)."""
    (batch, _, dim, hidden, slots), soft_experts = SOFT_SHAPES[quick]
    products = []
    for experts in soft_experts:
        rows, what = batch * batch_scale * (slots // experts), f"Soft MoE {experts} x {slots // experts} slots"
        products += [
            Product(f"{what}, fc1", experts, rows, dim, hidden, ragged=False),
            Product(f"{what}, fc2", experts, rows, hidden, dim, ragged=False),
        ]
    (tokens, dim), topk_experts = TOPK_SHAPES[quick]
    for experts, hidden in topk_experts:
        rows, what = tokens * batch_scale * 2 // experts, f"top-2 of {experts} SwiGLU experts"
        products += [
            Product(f"{what}, fc1 (gate and up)", experts, rows, dim, 2 * hidden, ragged=True),
            Product(f"{what}, fc2", experts, rows, hidden, dim, ragged=True),
        ]
    return products


class _Grouped(nn.Module):
    """The product as an expert bank runs it (:meth:`~moekit.moe.ExpertBank._local_forward`): the rows in the compute
    dtype, the float32 weights cast by the kernel. ``shared``: every expert's weight is one ``[in, out]`` tensor (a
    stride-0 bank), held in the compute ``dtype``: a cast of the bank would copy it for every expert."""

    def __init__(self, p: Product, shared: bool, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        shape, scale = (p.experts, p.in_features, p.out_features), p.in_features**-0.5
        if shared:  # a view: every expert's [in, out] is the one tensor's storage
            weight = (torch.randn(p.in_features, p.out_features, device=device) * scale).to(dtype).expand(shape)
        else:
            weight = torch.randn(shape, device=device) * scale
        self.weight = nn.Parameter(weight)
        sizes = torch.full((p.experts,), p.rows, dtype=torch.long, device=device)
        self.group_sizes = sizes if p.ragged else p.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(compute_dtype(x))
        with torch.autocast(x.device.type, enabled=False):
            return grouped_linear(x, self.weight, None, self.group_sizes, "auto")


class _Dense(nn.Module):
    """All the rows times one weight: one matmul (a linear layer's, on the library moekit's dense layers take)."""

    def __init__(self, p: Product, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(p.out_features, p.in_features, device=device) * p.in_features**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def table_products(args) -> None:
    """Print the ``products`` table (see the module docstring)."""
    device, dtype = args.backend.device, args.backend.autocast or torch.float32
    print("\n### The expert products alone: each expert's own weight, one weight for all, one dense product\n")
    print(
        "Forward + backward of each expert product of the soft and topk tables' layers: ms, GFLOP/s and share of the "
        "matmul peak. own / one weight: the cost of reading each expert's weight from memory; one weight / dense: "
        "the cost of short products.\n"
    )
    columns = "own weights | one weight for all | one dense product | own / one weight | one weight / dense"
    print(f"| product | experts x rows, in -> out | {columns} |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for p in layer_products(args.quick, args.batch_scale):
        x = torch.randn(p.experts * p.rows, p.in_features, device=device, requires_grad=True)
        cands = [
            Candidate("own", _Grouped(p, shared=False, device=device)),
            Candidate("shared", _Grouped(p, shared=True, device=device, dtype=dtype)),
            Candidate("dense", _Dense(p, device)),
        ]
        t = time_candidates(cands, x, args.rounds, args.backend)  # a candidate that fails is skipped, and said so
        cells = [
            f"{t[c] * 1e3:.1f} ms, {p.flops / t[c] / 1e9:.1f} ({p.flops / t[c] / args.peak:.0%})" if c in t else "-"
            for c in ("own", "shared", "dense")
        ]
        ratios = [
            f"{t[a] / t[b]:.2f}x" if a in t and b in t else "-" for a, b in (("own", "shared"), ("shared", "dense"))
        ]
        shape = f"{p.experts} x {p.rows}, {p.in_features} -> {p.out_features}"
        print(f"| {p.label} | {shape} | {' | '.join(cells + ratios)} |")
        sys.stdout.flush()
        del cands, x
