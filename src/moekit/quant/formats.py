"""Weight formats: the integer grids expert weights are rounded to, their group-wise scales, and bit packing.

A weight matrix ``w: [in, out]`` (an expert's ``fc1`` or ``fc2``, the :class:`~moekit.moe.ExpertBank`
layout) is split along ``in`` into groups of ``group_size`` rows; every (group, output column) pair has its
own scale (and, for the integer formats, zero point), stored as float16 / uint8.

* ``int8``, ``int4``, ``int2``: the asymmetric uniform grid of GPTQ,
  ``q = clamp(round(w / s) + z, 0, 2^b - 1)``, ``w ~ s (q - z)``.
* ``ternary``: the symmetric grid ``{-s, 0, +s}`` with an exact zero (QMoE's ternary), ``q in {0, 1, 2}``
  for ``-1, 0, +1``; its codes are stored entropy-coded (:mod:`moekit.quant.ternary_code`).

Scales come from a clipping search: the range ``c * [min, max]`` (``c * max|w|`` for ternary) with the
``c`` of :data:`CLIP_FACTORS` that gives the smallest squared error of the group, as GPTQ's ``mse`` option
(at 8 bits clipping does not pay and the full range is used). Rounding moves a weight inside its grid's
range by at most half a step; at the ends of an integer grid the zero point, an integer, can shift the
range by up to half a step more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FORMATS", "QuantFormat", "GroupQuantizer", "fit_quantizer", "pack_codes", "unpack_codes"]

FORMATS = ("int8", "int4", "int2", "ternary")
CLIP_FACTORS = torch.linspace(1.0, 0.3, 15).tolist()
_BITS = {"int8": 8, "int4": 4, "int2": 2, "ternary": 2}  # bits of one code before entropy coding


@dataclass(frozen=True)
class QuantFormat:
    """A weight format: ``name`` in :data:`FORMATS` and the rows per scale group along the input dim."""

    name: str
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"format {self.name!r} is not one of {FORMATS}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r} must be a positive int (rows per scale group)")

    @property
    def code_bits(self) -> int:
        """Bits of one packed code (ternary codes are packed as 2 bits before entropy coding)."""
        return _BITS[self.name]

    @property
    def levels(self) -> int:
        return 3 if self.name == "ternary" else 2**self.code_bits

    @property
    def symmetric(self) -> bool:
        return self.name == "ternary"

    def groups(self, rows: int) -> int:
        """Scale groups of a matrix with ``rows`` input rows (the last may be shorter)."""
        return -(-rows // min(self.group_size, rows))

    def group_rows(self, rows: int) -> int:
        return min(self.group_size, rows)


@dataclass
class GroupQuantizer:
    """The scales (and zero points) of some groups, broadcastable against the weights they quantize.
    ``scale`` is float16-representable, so that rounding and storage use the same grid."""

    fmt: QuantFormat
    scale: Tensor
    zero: Tensor | None  # None for the symmetric (ternary) grid

    def codes(self, w: Tensor) -> Tensor:
        """Integer codes ``0 .. levels - 1`` of ``w`` (float), the nearest grid points."""
        if self.fmt.symmetric:
            return (torch.round(w / self.scale).clamp_(-1, 1) + 1).to(torch.uint8)
        q = torch.round(w / self.scale) + self.zero
        return q.clamp_(0, self.fmt.levels - 1).to(torch.uint8)

    def values(self, codes: Tensor) -> Tensor:
        """The float weights ``codes`` stand for."""
        offset = 1.0 if self.fmt.symmetric else self.zero
        return (codes.float() - offset) * self.scale

    def round(self, w: Tensor) -> Tensor:
        return self.values(self.codes(w))


def _half_at_least(scale: Tensor) -> Tensor:
    """``scale`` rounded up to the nearest float16 value (the grid still spans the range), as float32. Subnormal
    float16 values serve small scales (down to 2^-24): the weights of a group spanning less than 255 x 2^-14 keep
    all 256 levels of int8."""
    nearest = scale.clamp(min=2**-24).half()
    up = torch.nextafter(nearest, nearest.new_tensor(float("inf")))
    return torch.where(nearest.float() < scale, up, nearest).float()


def _grid(fmt: QuantFormat, lo: Tensor, hi: Tensor) -> GroupQuantizer:
    """The grid covering ``[lo, hi]`` (``[-hi, hi]`` for ternary)."""
    if fmt.symmetric:
        return GroupQuantizer(fmt, _half_at_least(hi), None)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # the grid holds 0 exactly
    scale = _half_at_least((hi - lo) / (fmt.levels - 1))
    zero = torch.round(-lo / scale).clamp_(0, fmt.levels - 1)
    return GroupQuantizer(fmt, scale, zero)


def fit_quantizer(fmt: QuantFormat, w: Tensor, dim: int = -1) -> GroupQuantizer:
    """The grid of each group of ``w`` (the group's values run along ``dim``): the clipping factor with the
    smallest squared rounding error per group (module docstring). Returned tensors keep ``dim`` as size 1."""
    w = w.float()
    if fmt.symmetric:
        amax = w.abs().amax(dim, keepdim=True)
        lo, hi = -amax, amax
    else:
        lo, hi = w.amin(dim, keepdim=True), w.amax(dim, keepdim=True)
    factors = [1.0] if fmt.code_bits >= 8 else CLIP_FACTORS
    best, best_err = None, None
    for c in factors:
        grid = _grid(fmt, c * lo, c * hi)
        err = (grid.round(w) - w).pow_(2).sum(dim, keepdim=True)
        err.nan_to_num_(nan=float("inf"))  # a scale past float16's largest (inf: NaN weights) loses to any finite
        if best is None:
            best, best_err = grid, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best.scale = torch.where(better, grid.scale, best.scale)
        if best.zero is not None:
            best.zero = torch.where(better, grid.zero, best.zero)
    return best


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """``codes: [..., rows, cols]`` (uint8, each < 2^bits) -> ``[..., ceil(rows * bits / 8), cols]`` uint8,
    ``8 / bits`` consecutive rows per byte (low bits first); rows are padded with zeros to fill the last byte."""
    per_byte = 8 // bits
    rows = codes.shape[-2]
    pad = -rows % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-2], pad, codes.shape[-1])], dim=-2)
    grouped = codes.unflatten(-2, (-1, per_byte)).to(torch.int32)  # [..., bytes, per_byte, cols]
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device).view(per_byte, 1)
    return (grouped << shifts).sum(-2).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, rows: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``[..., bytes, cols]`` -> ``[..., rows, cols]`` uint8 codes."""
    if bits == 8:
        return packed[..., :rows, :]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(-1, 1)
    codes = (packed.unsqueeze(-2) >> shifts) & (2**bits - 1)  # [..., bytes, per_byte, cols]
    return codes.flatten(-3, -2)[..., :rows, :]
