"""``torch.compile`` a network in place: :func:`compile_network` (``task.compile=true``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["compile_network"]


def compile_network(net: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """``torch.compile`` ``net`` in place, as ``net.compile()`` means to: calls of ``net`` (forward hooks included) run
    compiled, its state-dict keys are unchanged, and a pickled or deep-copied ``net`` is the uncompiled one.

    ``net.compile()`` compiles ``net._call_impl``, a frame of torch's own ``module.py``, which Dynamo skips, relying on
    catching the frame of ``forward`` below it. On torch 2.11 it caught none where the forward is torch's own
    (``nn.Linear``), and none for the whole ViT-S/16 on an H200 image of torch 2.11 and Python 3.12 (the same kernels
    as eager mode, no frame compiled). Here the compiled frame is this function's own call of ``_call_impl``, which
    Dynamo traces, inlining ``_call_impl`` and everything below it: the way ``torch.compile(net)`` treats torch's
    own modules, without its ``_orig_mod.`` prefix on every state-dict key."""
    call_impl = net._call_impl

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        return call_impl(*args, **kwargs)

    net._compiled_call_impl = torch.compile(compiled_call, **compile_kwargs)
    return net
