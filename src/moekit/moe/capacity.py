"""How many rows each expert processes: tokens-choice capacity, experts-choice capacity and Soft MoE slots,
side by side, with one rounding rule.

A capacity factor ``c`` scales the rows an expert would get if the work were spread evenly:

* tokens-choice: each expert keeps at most ``C = R(k * N * c / E)`` of the ``k * N`` assignments of ``N``
  tokens that chose ``k`` experts each (Switch, GShard, V-MoE);
* experts-choice: each expert takes its top ``C = R(N * c / E)`` tokens, at most ``N`` (Zhou et al.: ``c`` is
  the average number of experts per token);
* Soft MoE: each expert gets ``p = R(m * c / E)`` slots for sequences of ``m`` tokens (``c`` slots per token).

``R`` is the one rounding rule: the nearest integer, halves rounded up, and at least 1 — after rounding the
product to 9 decimals, so that float noise (``2 * 6 * 1.1 / 4 = 3.3000000000000003``) never decides.

With a padding mask ``N`` counts the real tokens: the functions then take it as a device tensor (float64 arithmetic,
the rounding done on device, no host synchronisation) and return ``C`` as a long tensor of the same shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "round_capacity",
    "check_factor",
    "tokens_choice_capacity",
    "experts_choice_capacity",
    "soft_moe_slots",
    "Capacity",
]

CapacityScope = Literal["batch", "position", "group"]
CAPACITY_SCOPES = ("batch", "position", "group")


def round_capacity(rows: float | Tensor) -> int | Tensor:
    """``R(rows)``: the nearest integer (halves up), at least 1 (elementwise, long, for a tensor)."""
    if isinstance(rows, Tensor):
        return torch.floor(torch.round(rows.double(), decimals=9) + 0.5).clamp_min(1).long()
    return max(1, math.floor(round(rows, 9) + 0.5))


def _as_count(num_tokens: int | Tensor) -> int | Tensor:
    """A token count for the formulas: float64 when it is a tensor (as Python's floats are)."""
    return num_tokens.double() if isinstance(num_tokens, Tensor) else num_tokens


def check_factor(value, name: str, *, optional: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive finite number (or None when ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        dropless = ", or null for no capacity limit (dropless)" if optional else ""
        raise ValueError(f"{name}={value!r} must be a positive finite number{dropless}")


def tokens_choice_capacity(
    num_tokens: int | Tensor, top_k: int, num_experts: int, capacity_factor: float
) -> int | Tensor:
    """``C = R(k * N * c / E)``: the assignments one expert keeps of ``N`` tokens choosing ``k`` experts."""
    return round_capacity(top_k * _as_count(num_tokens) * capacity_factor / num_experts)


def experts_choice_capacity(num_tokens: int | Tensor, num_experts: int, capacity_factor: float) -> int | Tensor:
    """``C = R(N * c / E)``, at most ``N``: the tokens one expert takes."""
    capacity = round_capacity(_as_count(num_tokens) * capacity_factor / num_experts)
    if isinstance(capacity, Tensor):
        return torch.minimum(capacity, num_tokens.long())
    return min(num_tokens, capacity)


def soft_moe_slots(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """``p = R(m * c / E)``: the slots of one expert for sequences of ``m`` tokens."""
    return round_capacity(num_tokens * capacity_factor / num_experts)


@dataclass(kw_only=True)
class Capacity:
    """The capacity settings of a tokens-choice layer.

    Attributes:
        capacity_factor: ``c`` in training; None = dropless.
        eval_capacity_factor: ``c`` in evaluation; ``"same"`` reuses ``capacity_factor``.
        capacity_scope: ``"batch"``: one capacity over all ``batch * tokens`` tokens of the forward (vision);
            ``"position"``: a capacity over the ``batch`` tokens at each sequence position, so whether a token
            is dropped never depends on other positions (causal; cached decoding drops what the full forward
            drops); ``"group"``: a capacity over each group of ``group_size`` consecutive tokens of a sequence
            (V-MoE's and Switch's groups), served in token order - each token's choices before the next token's -
            so that a token's drops depend on earlier tokens only (causal; a decoding cache carries the counts);
            with ``batch_priority`` (not causal) all first choices by priority, then the second ones, as V-MoE.
        group_size: tokens per group of the ``"group"`` scope; None = the tokens of each call, one whole sequence
            (each image of a ViT), and refused with a decoding state (the Transformer LM sets ``max_seq_len``).
        batch_priority: Batch Prioritized Routing (Riquelme et al. 2021): when capacity binds, the tokens with
            the highest top router score are served first instead of the earliest ones.
    """

    capacity_factor: float | None = None
    eval_capacity_factor: float | None | Literal["same"] = "same"
    capacity_scope: CapacityScope = "batch"
    group_size: int | None = None
    batch_priority: bool = False

    def __post_init__(self) -> None:
        check_factor(self.capacity_factor, "capacity_factor", optional=True)
        if self.eval_capacity_factor == "same":
            self.eval_capacity_factor = self.capacity_factor
        check_factor(self.eval_capacity_factor, "eval_capacity_factor", optional=True)
        if self.capacity_scope not in CAPACITY_SCOPES:
            raise ValueError(
                f"capacity_scope={self.capacity_scope!r}; allowed: {', '.join(repr(s) for s in CAPACITY_SCOPES)}"
            )
        size = self.group_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"group_size={size!r} must be a positive int (tokens per group) or null (a sequence)")
        if size is not None and self.capacity_scope != "group":
            raise ValueError(
                f"group_size={size} counts capacity per group, but capacity_scope={self.capacity_scope!r}; "
                "set capacity_scope=group (or leave group_size null)"
            )

    @property
    def dropless(self) -> bool:
        """No capacity limit in training nor in evaluation."""
        return self.capacity_factor is None and self.eval_capacity_factor is None

    def factor(self, training: bool) -> float | None:
        return self.capacity_factor if training else self.eval_capacity_factor
