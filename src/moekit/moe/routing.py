"""What every router of the library shares: the float32 router projection, the softmax over the experts, the checksum
of its logits, and the :class:`Routing` a tokens-choice router returns (with :class:`Router`, the base of those
routers).

Routers compute their logits in float32 (at least), also under autocast: the softmaxes and top-k choices of
routing are sensitive to rounding, the expert matmuls are not.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernel_choices
from .cpu_matmul import linear

__all__ = [
    "count_ids",
    "Routing",
    "Router",
    "Float32State",
    "logit_checksum",
    "router_logits",
    "router_precision",
    "router_weight",
    "expert_softmax",
    "reset_own_parameters",
    "check_top_k",
    "check_router_init",
    "check_loss_weights",
    "recomputing",
]


@dataclass
class Routing:
    """A router's decision for ``N`` tokens.

    Attributes:
        expert_ids: ``[N, k]`` long, the chosen experts, best first (equal scores in ``torch.topk``'s order, which
            may differ between devices).
        gates: ``[N, k]`` float32 combine weights.
        probs: ``[N, E]`` float32 router distribution (for statistics), or None.
        priority: ``[N]`` score for Batch Prioritized Routing (the top router score), or None.
        aux_losses: weighted auxiliary losses of this routing.
        logit_checksum: :func:`logit_checksum` of the router's logits (None: no learned logits, as
            in hash routing).
    """

    expert_ids: Tensor
    gates: Tensor
    probs: Tensor | None = None
    priority: Tensor | None = None
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    logit_checksum: Tensor | None = None


def count_ids(ids: Tensor, size: int) -> Tensor:
    """``[size]`` long: how often each of ``0 .. size - 1`` occurs in ``ids``. ``torch.bincount`` with a static
    output shape, so that ``torch.compile`` traces it without a graph break."""
    flat = ids.reshape(-1)
    return torch.zeros(size, dtype=torch.long, device=ids.device).index_add_(0, flat, torch.ones_like(flat))


def router_weight(num_experts: int, in_features: int, device=None, dtype=None) -> nn.Parameter:
    """A ``[E, d]`` router projection with ``nn.Linear``'s default initialisation."""
    weight = nn.Parameter(torch.empty(num_experts, in_features, device=device, dtype=dtype))
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


@torch.no_grad()
def reset_own_parameters(module: nn.Module, projections: tuple[str, ...] = (), zeros: bool = False) -> None:
    """Redo the construction's initialisation of ``module``'s own parameters, in their order (so the same draws): those
    named in ``projections`` as :func:`router_weight`'s (then zeros with ``zeros``: ``router_init="zeros"``), the
    others zeros. The ``reset_parameters`` of a module built on the meta device and materialised with ``to_empty``
    (FSDP's and Lightning's ``empty_init`` pattern)."""
    for name, param in module.named_parameters(recurse=False):
        if name in projections:
            nn.init.kaiming_uniform_(param, a=math.sqrt(5))
        if name not in projections or zeros:
            param.zero_()


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing (``torch.utils.checkpoint``, timm's
    ``set_grad_checkpointing``) recomputing a forward that already ran. State a forward updates outside autograd
    (balancing counts, gate-mass totals) must not count the recomputation again, and it must route as the original
    forward did. (A compiled graph recomputes inside its backward graph, which replays no such update.)"""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def router_precision(t: Tensor) -> Tensor:
    """``t`` in float32 if it is in a lower precision (bf16/fp16); float32/float64 stay as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@functools.cache
def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _cpu_float_lanes() -> int:
    return kernel_choices.SOFTMAX_PAD_LANES.get(_cpu_capability(), 0)


def expert_softmax(logits: Tensor) -> Tensor:
    """``softmax(logits, dim=-1)``: router scores over the experts. On a CPU, float32 rows of fewer entries than
    its float vector holds (and at least a quarter of them: 4-15 experts under AVX-512, 2-7 under AVX2) are padded
    with ``-inf`` to a full vector first, for torch's fast kernel (``SOFTMAX_PAD_LANES`` of
    :mod:`moekit.moe.kernel_choices`); the values are the same."""
    num = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not torch.compiler.is_compiling():
        lanes = _cpu_float_lanes()
        if num < lanes <= 4 * num:
            return torch.softmax(F.pad(logits, (0, lanes - num), value=-math.inf), dim=-1)[..., :num]
    return torch.softmax(logits, dim=-1)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """``x [N, d] @ weight[E, d]^T`` in (at least) float32 with autocast off."""
    with torch.autocast(x.device.type, enabled=False):
        x = router_precision(x)
        return linear(x, weight.to(x.dtype))


def logit_checksum(*logits: Tensor) -> Tensor:
    """The sum of every entry of ``logits`` as a detached float32 device scalar: finite exactly when every
    logit is finite (NaN and inf propagate through a sum; finite logits would have to exceed ~1e38 in
    total to overflow, itself a divergence). One reduction per tensor and no host synchronisation, so
    layers record it on every forward and a reader (:class:`~moekit.callbacks.NonFiniteGuard`) syncs
    only when a training step has already gone bad."""
    total = logits[0].detach().float().sum()
    for t in logits[1:]:
        total = total + t.detach().float().sum()
    return total


class Float32State(nn.Module):
    """A module whose floating-point buffers are state counted outside autograd (balancing counts and biases,
    gate-mass totals): they stay float32 when the module is cast to a lower precision (``.to(torch.bfloat16)``,
    ``.half()``, Lightning's ``bf16-true``), where the small updates of large totals would round away (bf16 holds
    no odd integer above 256, and ``0.5 + 0.001`` is ``0.5`` in it); a cast to float64 applies."""

    def _apply(self, fn, recurse=True):
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old is None or new is None or not new.is_floating_point() or new.dtype.itemsize >= 4:
                continue
            source = new if old.is_meta else old  # materialised from the meta device: no values to keep
            self._buffers[name] = source.to(device=new.device, dtype=torch.float32)
        return self


class Router(Float32State):
    """Base of the tokens-choice routers: ``forward(x [N, d], token_ids [N] or None, mask [N] or None) -> Routing``;
    ``mask`` (bool, False for padding) keeps padding out of the router's losses and balancing state.

    Attributes:
        num_experts: ``E``; top_k: experts per token ``k``.
        needs_token_ids: the router reads token ids (hash routing), not the tokens.
    """

    needs_token_ids: ClassVar[bool] = False
    num_experts: int
    top_k: int

    def balancing_step(self) -> None:
        """Called once per optimizer step; routers with state updated outside autograd override it."""

    def discard_balancing_step(self) -> None:
        """Called instead of :meth:`balancing_step` when the optimizer step was skipped."""


# Checks of the settings every router config shares.
def check_top_k(num_experts: int, top_k: int, what: str = "top_k") -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive int")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{what}={top_k!r} must be an int in [1, {num_experts}]")


def check_router_init(router_init: str) -> None:
    if router_init not in ("default", "zeros"):
        raise ValueError(f"router_init={router_init!r}; allowed: 'default', 'zeros'")


def check_loss_weights(**weights: float) -> None:
    for name, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0 (0 turns it off)")
