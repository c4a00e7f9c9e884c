"""The FLOP counter every FLOP figure of moekit is measured with: ``torch.utils.flop_counter.FlopCounterMode`` with
formulas for the kernels it has none for, under which compiled code runs eagerly."""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

__all__ = ["flop_counter"]


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _rnn_layer_flops(input_shape, weight_ih_shape, weight_hh_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten.mkldnn_rnn_layer`` (one CPU LSTM layer): the input and recurrent matmuls of every token."""
    tokens = math.prod(input_shape[:-1])
    return 2 * tokens * (math.prod(weight_ih_shape) + math.prod(weight_hh_shape))


def _cudnn_rnn_flops(input_shape, weight_shapes, *args, out_shape=None, **kwargs) -> int:
    """``aten._cudnn_rnn`` (all layers of a CUDA RNN): every 2-D weight's matmul over every token."""
    tokens = math.prod(input_shape[:-1])
    return 2 * tokens * sum(math.prod(shape) for shape in weight_shapes if len(shape) == 2)


def _addmm_inplace_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten.addmm_`` (``c.addmm_(a, b)``: the CPU loop's products that add into one output): ``2 M K N``, as the
    counter's own formula for ``addmm``."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten._grouped_mm`` (the experts' ``grouped_mm`` kernel): 2 x the multiply-adds of all groups. Rows split
    by group ``[M, K] @ [E, K, N]`` (forward, input gradient), the contraction split ``[K, M] @ [M, N]`` (weight
    gradient) and columns split ``[E, M, K] @ [K, N]`` each make ``2 M K N``; 3-D x 3-D is a batched matmul."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * math.prod(a_shape) * b_shape[2]
    if len(a_shape) == 3:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


# Kernels FlopCounterMode has no formula for: the CPU kernel of F.scaled_dot_product_attention,
# the fused LSTM kernels (other RNN paths decompose into matmuls the counter sees), grouped matmuls and the in-place
# addmm_ (the counter counts addmm only).
_EXTRA_FLOP_FORMULAS = {
    op: formula
    for op, formula in (
        (getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), _cpu_sdpa_flops),
        (getattr(torch.ops.aten, "mkldnn_rnn_layer", None), _rnn_layer_flops),
        (getattr(torch.ops.aten, "_cudnn_rnn", None), _cudnn_rnn_flops),
        (getattr(torch.ops.aten, "_grouped_mm", None), _grouped_mm_flops),
        (torch.ops.aten.addmm_, _addmm_inplace_flops),
    )
    if op is not None
}


class _EagerFlopCounter(FlopCounterMode):
    """A ``FlopCounterMode`` under which compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``).

    Dynamo does not trace under a dispatch mode, and torch 2.11 marks a frame it first meets there as never to be
    compiled: ``train()`` measures a network's FLOPs before fitting it, and on a torch 2.11 GPU image a network
    compiled by ``task.compile=true`` then trained entirely in eager mode. Under ``force_eager`` Dynamo never sees
    the frame, and its first call outside the counter compiles it."""

    def __enter__(self):
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._eager.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._eager.__exit__(*exc_info)


def flop_counter() -> FlopCounterMode:
    """``torch.utils.flop_counter.FlopCounterMode`` that also counts the kernels it has no formula for (grouped
    matmuls, CPU attention, fused LSTMs), and under which compiled code runs eagerly: what every FLOP figure of
    moekit is measured with."""
    return _EagerFlopCounter(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
