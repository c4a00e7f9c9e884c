"""Rounding a bank of expert matrices to a :class:`~moekit.quant.formats.QuantFormat`: round to nearest
(RTN) and GPTQ (Frantar et al. 2023), batched over the experts as in QMoE (Frantar & Alistarh 2023).

Both take ``w_EIO: [experts, in, out]`` (the :class:`~moekit.moe.ExpertBank` layout) and return
:class:`QuantizedCodes`: ``codes [experts, in, out]`` (uint8), ``scale [experts, groups, out]`` and, for
the integer formats, ``zero [experts, groups, out]``.

GPTQ quantizes the input rows one after the other and spreads each row's rounding error over the rows
not yet quantized, weighted by the inverse Hessian ``H = X^T X`` of the inputs ``X`` that reach the expert:
it minimises ``||X W - X Q||^2`` rather than ``||W - Q||^2``. For row ``i`` with ``U`` the upper Cholesky
factor of ``H^-1``::

    q_i = round(w_i);  err = (w_i - q_i) / U_ii;  w_j -= err * U_ij   for j > i

applied lazily in blocks of rows. A group's scale is fitted when its first row is reached, from the
weights as the earlier rows' errors left them. Inputs no token ever set (``H_ii = 0``) get weight zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .formats import GroupQuantizer, QuantFormat, fit_quantizer

__all__ = ["QuantizedCodes", "rtn_quantize", "gptq_quantize", "DAMPING"]

DAMPING = 0.01
"""GPTQ's dampening: ``H + DAMPING * mean(diag H) * I`` keeps the inverse stable."""


@dataclass
class QuantizedCodes:
    """The codes of ``[experts, in, out]`` weights and the grid of each (expert, group, out column)."""

    fmt: QuantFormat
    codes: Tensor  # [E, I, O] uint8
    scale: Tensor  # [E, G, O] float16
    zero: Tensor | None  # [E, G, O] uint8, None for ternary

    def dequantize(self) -> Tensor:
        """The float weights ``[E, I, O]`` the codes stand for."""
        rows = self.codes.shape[1]
        g = self.fmt.group_rows(rows)
        scale = self.scale.float().repeat_interleave(g, dim=1)[:, :rows]
        if self.zero is None:
            return (self.codes.float() - 1.0) * scale
        zero = self.zero.float().repeat_interleave(g, dim=1)[:, :rows]
        return (self.codes.float() - zero) * scale


def _store(fmt: QuantFormat, scales: list[Tensor], zeros: list[Tensor], codes: Tensor) -> QuantizedCodes:
    scale = torch.stack(scales, dim=1).half()
    zero = None if fmt.symmetric else torch.stack(zeros, dim=1).to(torch.uint8)
    return QuantizedCodes(fmt, codes, scale, zero)


def rtn_quantize(w_EIO: Tensor, fmt: QuantFormat) -> QuantizedCodes:
    """Round every weight to the nearest point of its group's grid (scales from the clipping search)."""
    E, D, N = w_EIO.shape  # experts, inputs, outputs
    g = fmt.group_rows(D)
    G = fmt.groups(D)
    w = w_EIO.float()
    if G * g != D:  # zero rows fill the last group: 0 is on every grid and moves no scale
        w = torch.cat([w, w.new_zeros(E, G * g - D, N)], dim=1)
    w_EGgN = w.view(E, G, g, N)
    grid = fit_quantizer(fmt, w_EGgN, dim=2)  # scale [E, G, 1, N]
    codes = grid.codes(w_EGgN).view(E, G * g, N)[:, :D]
    zeros = [] if fmt.symmetric else list(grid.zero[:, :, 0].unbind(1))
    return _store(fmt, list(grid.scale[:, :, 0].unbind(1)), zeros, codes.contiguous())


def gptq_quantize(
    w_EIO: Tensor,
    hessian_EII: Tensor,
    fmt: QuantFormat,
    *,
    block_size: int = 128,
    damping: float = DAMPING,
) -> QuantizedCodes:
    """GPTQ for every expert at once (module docstring).

    Args:
        w_EIO: ``[experts, in, out]`` weights.
        hessian_EII: ``[experts, in, in]``, each expert's ``X^T X`` (any positive scale) over the rows routed
            to it. An identity Hessian makes GPTQ round to nearest.
        fmt: the weight format.
        block_size: rows per lazy update (a multiple of the group size is rounded to, when groups are smaller).
    """
    E, D, N = w_EIO.shape  # experts, inputs, outputs
    if hessian_EII.shape != (E, D, D):
        raise ValueError(f"gptq_quantize: hessian {tuple(hessian_EII.shape)} does not match weights {(E, D, N)}")
    g = fmt.group_rows(D)
    if g < block_size:
        block_size = max(g, block_size // g * g)
    W = w_EIO.transpose(1, 2).double().clone()  # [E, N, D]: GPTQ's layout, the inputs last
    H = hessian_EII.double().clone()
    diag = H.diagonal(dim1=1, dim2=2)
    dead = diag == 0  # [E, D]
    diag.masked_fill_(dead, 1.0)
    W.masked_fill_(dead.unsqueeze(1), 0.0)
    diag.add_(damping * diag.mean(dim=1, keepdim=True))
    L, info = torch.linalg.cholesky_ex(H)
    if bool(info.any()):
        raise ValueError(
            f"with damping={damping} the Hessian of expert(s) {info.nonzero().flatten().tolist()} is not positive "
            f"definite (their calibration inputs span fewer than the {D} input dimensions); raise damping (GPTQ's "
            "default is 0.01)"
        )
    U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # [E, D, D]

    codes = torch.empty(E, N, D, dtype=torch.uint8, device=W.device)
    scales: list[Tensor] = []
    zeros: list[Tensor] = []
    grid: GroupQuantizer | None = None
    for i1 in range(0, D, block_size):
        i2 = min(i1 + block_size, D)
        W1 = W[:, :, i1:i2].clone()
        U1 = U[:, i1:i2, i1:i2]
        err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                # the group's rows as the errors so far left them: its rows past this block still lack the updates
                # this block's rows owe them (applied lazily at the block's end), so they are applied here
                ahead = W[:, :, i2 : col + g] - torch.bmm(err1[:, :, :i], U[:, i1 : i1 + i, i2 : col + g])
                group = torch.cat([W1[:, :, i : i + g], ahead], dim=2)
                grid = fit_quantizer(fmt, group.float(), dim=-1)  # scale [E, N, 1]
                scales.append(grid.scale[..., 0])
                if grid.zero is not None:
                    zeros.append(grid.zero[..., 0])
            w = W1[:, :, i : i + 1]  # [E, N, 1]
            q = grid.codes(w.float())
            codes[:, :, col] = q[..., 0]
            err = (w - grid.values(q).double()) / U1[:, i, i].view(E, 1, 1)  # [E, N, 1]
            W1[:, :, i:] -= err * U1[:, i : i + 1, i:]
            err1[:, :, i : i + 1] = err
        W[:, :, i2:] -= torch.bmm(err1, U[:, i1:i2, i2:])
    return _store(fmt, scales, zeros, codes.transpose(1, 2).contiguous())
