"""Rotary position embedding for the Transformer LM (and its Mixture-of-Depths blocks, whose chosen tokens keep
their own positions)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021), rotate-half layout: the first and second halves of
    each head's channels form the pairs rotated by ``position * base^(-2i / head_dim)``.

    ``forward(x: [batch, heads, tokens, head_dim], start, positions=None)`` rotates tokens at positions
    ``start .. start + tokens - 1`` (below ``max_seq_len``), or at ``positions: [batch, tokens]`` (the tokens a
    Mixture-of-Depths block chose); the rotation is applied in float32 at least (float64 input stays float64), then
    cast back to ``x``'s dtype.

    The ``cos`` / ``sin`` tables are float32 buffers, computed on the CPU and moved: a cast of the model
    (``model.to(torch.bfloat16)``) leaves them in float32, and a move or ``to_empty`` (a model built on the meta
    device) recomputes them, since they are not in the state dict.
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim={head_dim} must be even (dim / num_heads)")
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, base
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the float32 tables on the CPU, then move them to the device the buffers are on."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device="cpu") / self.head_dim
        inv_freq = self.base**-exponents
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device="cpu")
        angles = torch.outer(positions, inv_freq)  # [max_seq_len, hd / 2]
        self.cos = angles.cos().to(self.cos.device)
        self.sin = angles.sin().to(self.sin.device)

    def _apply(self, fn, recurse: bool = True):
        tables = self.cos, self.sin
        super()._apply(fn, recurse)
        if self.cos is tables[0]:
            return self
        if self.cos.dtype != torch.float32 and not tables[0].is_meta:  # a cast: the float32 tables, where fn put them
            self.cos, self.sin = (table.to(self.cos.device) for table in tables)
        else:  # moved or emptied (to_empty hands out uninitialised memory): recompute
            self.reset_parameters()
        return self

    def forward(self, x: Tensor, start: int, positions: Tensor | None = None) -> Tensor:
        if positions is None:
            tokens = x.shape[-2]
            if start + tokens > self.max_seq_len:
                raise ValueError(
                    f"RotaryEmbedding: positions {start} .. {start + tokens - 1} exceed max_seq_len={self.max_seq_len}"
                    f"; build it with max_seq_len >= {start + tokens}"
                )
            cos, sin = self.cos[start : start + tokens], self.sin[start : start + tokens]
        else:  # [batch, tokens, hd / 2] -> [batch, 1, tokens, hd / 2], broadcast over heads
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        dtype = torch.promote_types(x.dtype, torch.float32)  # float32 for bf16 / fp16, float64 kept
        cos, sin = cos.to(dtype), sin.to(dtype)
        first, second = x.to(dtype).chunk(2, dim=-1)  # [..., tokens, hd / 2] each
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.to(x.dtype)
