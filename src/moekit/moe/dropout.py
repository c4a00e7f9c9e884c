"""Dropout whose CPU mask takes four elements from each 64-bit random draw.

torch's CPU dropout draws its mask with ``bernoulli_``. ATen hands that to MKL's VSL only on Intel CPUs; elsewhere it
runs on one thread, one double-precision draw per element, and in the Transformer LM's training step (dropout 0.1 on
the embeddings, attention outputs and feed-forwards) dropout took 31% of the step on a 2-core AMD EPYC in float32.

Here the mask comes from the same generator's 64-bit draws (``random_`` over the whole int64 range), each split into
four 16-bit levels, uniform on ``[-32768, 32767]``; an element is dropped where its level falls in the lowest
``round(p * 65536)``. The drop probability is thus ``p`` rounded to a multiple of 1/65536 (0.1 -> 0.1000061) and the
kept elements are scaled by one over the exact keep probability, so the output's expectation is the input, as with
:func:`torch.nn.functional.dropout`. Forward + backward of an ``[8192, 1024]`` float32 activation on that CPU: 27 ms
against ``F.dropout``'s 110. A generator draws on one thread: a large mask is drawn in chunks, each by a generator
seeded from the default one, over the CPU's threads (``CHUNK_DRAWS``).

Under ``torch.compile`` the draws are one opaque operator, so a compiled model draws the masks eager mode draws
(inductor's own CPU masks were as slow as torch's in the compiled Transformer LM). On devices outside
``FAST_DROPOUT_DEVICES`` (:mod:`moekit.moe.kernel_choices`; GPUs' dropout kernels draw in parallel), for a ``p``
that rounds to 0 or to 65536 levels, and where the dtype cannot hold the scale (float16 at 65535 levels: 65536 is
past its largest value), :func:`dropout` is ``F.dropout``. The Transformer LM's attention applies it to
the probabilities on those devices (:func:`moekit.models.attention.attention_with_dropout`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernel_choices
from .cpu_threads import for_each_part

__all__ = ["Dropout", "dropout", "use_fast_dropout"]

LEVELS = 1 << 16  # 16-bit levels per element
# A mask of more 64-bit draws than this is drawn in chunks of it, each from its own generator seeded by one draw of the
# default generator, the chunks spread over the CPU's threads (a generator draws on one thread). A fixed size: a mask
# depends on the seed alone, not on the thread count. 2M draws (an [8192, 1024] mask) on a 2-core Xeon with AMX:
# 5.7 ms from one generator, 3.1 in chunks of 512K over 2 threads.
CHUNK_DRAWS = 1 << 19


@torch.library.custom_op("moekit::dropout_levels", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _levels(like: Tensor) -> Tensor:
    """``[like.numel()]`` int16 levels, uniform on ``[-32768, 32767]``: four from each 64-bit draw of the default CPU
    generator (beyond ``CHUNK_DRAWS`` draws, of generators it seeds). A custom operator, so that ``torch.compile`` runs
    these draws (no graph break) and neither merges nor recomputes them (seeded nondeterministic). ``like``, the tensor
    to mask, is an argument (its values unread), so that dropouts of two tensors are two calls: torch 2.11's
    common-subexpression pass over the joint forward and backward graph merged two calls of one size despite the tag,
    drawing one mask for both."""
    n = like.numel()
    draws = torch.empty((n + 3) // 4, dtype=torch.int64)
    chunks = draws.split(CHUNK_DRAWS)
    if len(chunks) == 1:
        draws.random_(-(2**63), None)  # the whole int64 range
    else:  # a generator per chunk, seeded from the default one: the chunks draw on every thread at once
        seeds = torch.empty(len(chunks), dtype=torch.int64).random_(-(2**63), None).tolist()

        def draw(i: int) -> None:
            chunks[i].random_(-(2**63), None, generator=torch.Generator().manual_seed(seeds[i]))

        for_each_part(draw, len(chunks))
    return draws.view(torch.int16)[:n]


@_levels.register_fake
def _(like: Tensor) -> Tensor:
    return torch.empty(like.numel(), dtype=torch.int16)


def dropout(x: Tensor, p: float, training: bool = True, inplace: bool = False) -> Tensor:
    """``F.dropout(x, p, training, inplace)`` with the CPU mask described in the module docstring."""
    if not training or p == 0.0:
        return x
    dropped_levels = round(p * LEVELS)
    if x.device.type not in kernel_choices.FAST_DROPOUT_DEVICES or not 0 < dropped_levels < LEVELS:
        return F.dropout(x, p, training, inplace)
    keep_scale = LEVELS / (LEVELS - dropped_levels)  # one over the exact keep probability
    if x.is_floating_point() and keep_scale > torch.finfo(x.dtype).max:  # float16 at 65535 levels: 65536 is inf
        return F.dropout(x, p, training, inplace)
    level = _levels(x.detach()).view(x.shape)
    noise = _noise(level, dropped_levels - LEVELS // 2, keep_scale, x.dtype)  # [x.shape]: 0 or 1 / keep probability
    return x.mul_(noise) if inplace else x * noise


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer dtype of each float size


def _noise(level: Tensor, lowest_kept: int, scale: float, dtype: torch.dtype) -> Tensor:
    """``scale`` where ``level >= lowest_kept``, else 0, in ``dtype``: the comparison written as 0s and 1s of an integer
    dtype of ``dtype``'s size, times the bit pattern of ``scale``, read as ``dtype`` (``torch.where``'s values: on a CPU
    that and a bool mask cast to the integers took 2.3-2.8x as long as these two passes). Under ``torch.compile``,
    ``where`` (fused there)."""
    bits = _BITS.get(dtype.itemsize)
    if bits is None or not dtype.is_floating_point or torch.compiler.is_compiling():
        return torch.where(level >= lowest_kept, torch.tensor(scale, dtype=dtype), 0.0)
    pattern = torch.tensor(scale, dtype=dtype, device=level.device).view(bits)  # a 0-dim tensor: no host read
    keep = torch.ge(level, lowest_kept, out=torch.empty(level.shape, dtype=bits, device=level.device))
    return keep.mul_(pattern).view(dtype)


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` through :func:`dropout` (the fast CPU mask); same arguments, no state."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training, self.inplace)


def use_fast_dropout(module: nn.Module) -> nn.Module:
    """Replace every :class:`torch.nn.Dropout` inside ``module`` (those timm's blocks build) with :class:`Dropout` of
    the same ``p``, in place; the state dict does not change. Returns ``module``."""
    for parent in module.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Dropout:
                setattr(parent, name, Dropout(child.p, child.inplace))
    return module
