"""Dropping overpowering experts (Eigen, Ranzato and Sutskever 2013, "Learning factored representations in a deep
mixture of experts").

Without balancing, "the experts that perform best for the first few examples end up overpowering the remaining
experts": their gates grow, they are chosen more, they train more. Eigen et al. keep a running total of the gate
mass each expert has received and, during training, give an expert whose total runs ahead of the mean total by
more than a margin a gate of zero for the step; the other experts' gates are renormalised. Nothing changes at
inference.

Here the mass an expert receives in a forward is the sum of its (post-dropping) gates over the forward's tokens
divided by the number of tokens, so that one forward adds at most 1 to the totals whatever its batch size, and the
margin is in those units: ``margin=1`` lets an expert run one whole forward's worth of gate mass ahead of the mean
before it is dropped. An expert that is dropped receives nothing, so it comes back once the others catch up. The
totals are a buffer (saved in checkpoints) and are counted on each process separately. A forward that activation
checkpointing recomputes during backward drops the experts its original forward dropped and adds nothing; a
non-finite mass (a forward gone NaN) adds nothing either.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .routing import Float32State, recomputing

__all__ = ["OverpoweringExperts", "check_margin"]


def check_margin(margin: float | None) -> None:
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0):
        raise ValueError(
            f"overpower_margin={margin!r} must be a number >= 0 (how far, in forwards' worth of gate mass, an "
            "expert may run ahead of the mean before it is dropped) or null for no dropping"
        )


class OverpoweringExperts(Float32State):
    """The running gate-mass totals of ``num_experts`` experts and the experts they drop.

    ``keep_E()`` gives the ``[E]`` 0/1 mask of the experts allowed in this training forward (all ones in eval
    mode); ``received(mass_E, num_tokens)`` adds a forward's gate mass (training only). The totals stay float32 in a
    layer cast to bf16 / fp16 (:class:`~moekit.moe.routing.Float32State`).
    """

    def __init__(self, num_experts: int, margin: float, device=None) -> None:
        super().__init__()
        check_margin(margin)
        self.margin = float(margin)
        self.register_buffer("gate_mass_total", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self._keep_E: Tensor | None = None  # the latest training forward's, for its recomputation

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """No gate mass received (for a module built on the meta device and materialised with ``to_empty``)."""
        self.gate_mass_total.zero_()

    def keep_E(self) -> Tensor:
        total = self.gate_mass_total
        if not self.training:
            return torch.ones_like(total)
        if self._keep_E is None or not recomputing():  # recomputed: the totals already hold the original's mass
            self._keep_E = (total - total.mean() <= self.margin).float()
        return self._keep_E

    def without_dropped(self, x_NE: Tensor) -> Tensor:
        """``x_NE`` with the dropped experts' columns at -inf: neither chosen nor given softmax mass."""
        return x_NE.masked_fill(self.keep_E() == 0, -torch.inf)

    @torch.no_grad()
    def received(self, mass_E: Tensor, num_tokens: int | Tensor) -> None:
        """Add ``mass_E``, the summed gates each expert received from the ``num_tokens`` real tokens of a training
        forward (a device count under a padding mask)."""
        if self.training and not recomputing():
            count = num_tokens.clamp_min(1) if isinstance(num_tokens, Tensor) else max(num_tokens, 1)
            # a non-finite mass (a forward gone NaN, whose step is skipped) counts 0: a NaN total would drop every
            # expert for good
            self.gate_mass_total += torch.nan_to_num(mass_E.float() / count, nan=0.0, posinf=0.0, neginf=0.0)

    def extra_repr(self) -> str:
        return f"margin={self.margin}"
