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
    (``nn.Linear``). Here the compiled frame is this function's own call of ``_call_impl``, which
    Dynamo traces, inlining ``_call_impl`` and everything below it: the way ``torch.compile(net)`` treats torch's
    own modules, without its ``_orig_mod.`` prefix on every state-dict key."""
    call_impl = net._call_impl

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        return call_impl(*args, **kwargs)

    # Dynamo keeps a code object's compiled graphs, at most torch._dynamo.config.recompile_limit (8) of them, with the
    # code object: each network gets a copy of its own, so that the networks of a process (a sweep's jobs, a train
    # and an eval graph each) do not share one budget and run eagerly once it is spent.
    compiled_call.__code__ = compiled_call.__code__.replace()
    net._compiled_call_impl = torch.compile(compiled_call, **compile_kwargs)
    return net
