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
    ``start .. start + tokens - 1``, or at ``positions: [batch, tokens]`` (the tokens a Mixture-of-Depths
    block chose); the rotation is applied in float32 (then cast back to ``x``'s dtype).
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim={head_dim} must be even (dim / num_heads)")
        self.base = base
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # [max_seq_len, hd / 2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, start: int, positions: Tensor | None = None) -> Tensor:
        if positions is None:
            tokens = x.shape[-2]
            cos, sin = self.cos[start : start + tokens], self.sin[start : start + tokens]
        else:  # [batch, tokens, hd / 2] -> [batch, 1, tokens, hd / 2], broadcast over heads
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        cos, sin = cos.float(), sin.float()
        first, second = x.float().chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.to(x.dtype)
