"""Expert banks that hold their weights quantized and dequantize one expert at a time inside the forward.

:class:`QuantizedExpertBank` replaces an :class:`~moekit.moe.ExpertBank` in a trained model (same call,
``bank(x [rows, in] sorted by expert, group_sizes)``; inference only). Each of its two matrices is a
:class:`QuantizedWeight`: packed integer codes with float16 scales, or for ternary weights the Tunstall
codewords of :mod:`moekit.quant.ternary_code`. An expert's float weights exist only while its rows are
computed, so the resident memory of the experts is that of the codes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moekit.moe.experts import ExpertBank, compute_dtype
from moekit.moe.gated_activation import expert_activation
from moekit.moe.grouped_linear import GroupSizes

from .formats import QuantFormat, pack_codes, unpack_codes
from .methods import QuantizedCodes
from .ternary_code import TunstallCode, build_code, choose_code, chunk_ends, chunk_lengths, decode, encode, entropy_bits

__all__ = ["QuantizedWeight", "QuantizedExpertBank", "INTEGER_KEYS", "TERNARY_KEYS"]

INTEGER_KEYS = ("scale", "packed", "zero")
TERNARY_KEYS = ("scale", "counts", "code_bits", "codewords", "chunk_offsets")


class QuantizedWeight(nn.Module):
    """One ``[experts, in, out]`` matrix in a :class:`~moekit.quant.formats.QuantFormat`.

    Persistent buffers (what a file stores): ``scale [E, G, out]`` float16; integer formats: ``packed
    [E, ceil(in * bits / 8), out]`` uint8 and ``zero [E, G, out]`` uint8; ternary: ``counts [3]`` and
    ``code_bits`` (all a reader needs to rebuild the Tunstall code), ``codewords`` and ``chunk_offsets``.
    The decoding tables are non-persistent buffers.
    """

    def __init__(
        self,
        fmt: QuantFormat,
        shape: tuple[int, int, int],
        tensors: dict[str, Tensor],
        code: TunstallCode | None = None,
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.num_experts, self.in_features, self.out_features = shape
        names = TERNARY_KEYS if fmt.symmetric else INTEGER_KEYS
        missing = [n for n in names if n not in tensors]
        if missing:
            raise KeyError(f"a {fmt.name} weight needs {', '.join(names)}; missing: {', '.join(missing)}")
        for name in names:
            self.register_buffer(name, tensors[name])
        if fmt.symmetric:
            code = code or build_code(self.counts, int(self.code_bits))
            self.register_buffer("word_table", code.table, persistent=False)
            self.register_buffer("word_lengths", code.lengths, persistent=False)
            # Per chunk, the last codeword and its share of symbols; per expert, its codewords' range.
            lengths = chunk_lengths(self.in_features * self.out_features).repeat(self.num_experts)
            self.register_buffer("last_word", self.chunk_offsets[1:] - 1, persistent=False)
            self.register_buffer(
                "last_length", chunk_ends(self.codewords, self.chunk_offsets, lengths, code), persistent=False
            )
            self.chunks_per_expert = lengths.numel() // self.num_experts
            self.word_ranges = self.chunk_offsets[:: self.chunks_per_expert].tolist()

    @classmethod
    def from_codes(cls, q: QuantizedCodes) -> QuantizedWeight:
        """Pack (or, for ternary, Tunstall-code) the output of :func:`~moekit.quant.rtn_quantize` /
        :func:`~moekit.quant.gptq_quantize`."""
        shape = tuple(q.codes.shape)  # [E, in, out]
        if not q.fmt.symmetric:
            tensors = {"scale": q.scale, "packed": pack_codes(q.codes, q.fmt.code_bits), "zero": q.zero}
            return cls(q.fmt, shape, tensors)
        counts = torch.bincount(q.codes.flatten().long(), minlength=3)
        code = choose_code(counts, q.codes.numel())  # one decoding table serves all the experts of the matrix
        codewords, offsets = encode(q.codes.flatten(1), code)
        tensors = {
            "scale": q.scale,
            "counts": counts,
            "code_bits": torch.tensor(code.bits),
            "codewords": codewords,
            "chunk_offsets": offsets,
        }
        return cls(q.fmt, shape, tensors, code)

    def codes(self, expert: int) -> Tensor:
        """``[in, out]`` uint8 codes of one expert."""
        if not self.fmt.symmetric:
            return unpack_codes(self.packed[expert], self.fmt.code_bits, self.in_features)
        lo, hi = self.word_ranges[expert], self.word_ranges[expert + 1]
        chunks = slice(expert * self.chunks_per_expert, (expert + 1) * self.chunks_per_expert)
        symbols = decode(
            self.codewords[lo:hi],
            self.last_word[chunks] - lo,
            self.last_length[chunks],
            self.word_table,
            self.word_lengths,
        )
        return symbols.view(self.in_features, self.out_features)

    def dequantize(self, expert: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[in, out]`` float weights of one expert: computed in float32 (exact: a float16 scale times a small
        integer) and rounded to ``dtype`` once, the weights :meth:`QuantizedCodes.dequantize` gives."""
        g = self.fmt.group_rows(self.in_features)
        scale = self.scale[expert].float().repeat_interleave(g, dim=0)[: self.in_features]
        codes = self.codes(expert).float()
        if self.fmt.symmetric:
            return ((codes - 1) * scale).to(dtype)
        zero = self.zero[expert].float().repeat_interleave(g, dim=0)[: self.in_features]
        return ((codes - zero) * scale).to(dtype)

    def _apply(self, fn, recurse: bool = True):
        """Moves follow the module; dtype casts (``module.to(torch.bfloat16)``, ``trainer.precision=bf16-true``)
        leave the float16 scales as they are: they are a part of the codes, not a float weight."""
        scale = self.scale
        super()._apply(fn, recurse)
        if self.scale.dtype != scale.dtype:
            self.scale = scale.to(self.scale.device)
        return self

    def stored_bytes(self) -> int:
        """Bytes of the persistent buffers (what a checkpoint holds)."""
        return sum(b.numel() * b.element_size() for b in self.state_dict().values())

    def resident_bytes(self) -> int:
        """Bytes held in memory, the ternary decoding tables included."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def ternary_stats(self) -> dict[str, float] | None:
        """For ternary weights: the zero fraction, the symbols' entropy and the codeword bits per weight."""
        if not self.fmt.symmetric:
            return None
        counts = self.counts
        return {
            "zero_fraction": float(counts[1]) / float(counts.sum()),
            "entropy_bits": entropy_bits(counts),
            "code_bits_per_weight": self.codewords.numel() * int(self.code_bits) / float(counts.sum()),
        }

    def extra_repr(self) -> str:
        sizes = f"experts={self.num_experts}, {self.in_features}->{self.out_features}"
        return f"{self.fmt.name}, group_size={self.fmt.group_size}, {sizes}"


class QuantizedExpertBank(nn.Module):
    """An :class:`~moekit.moe.ExpertBank` whose ``fc1`` / ``fc2`` weights are :class:`QuantizedWeight`
    (biases stay float). ``forward(x, group_sizes)`` computes each expert on its rows with its weights
    dequantized for that call only. Inference only: the codes take no gradients."""

    def __init__(self, bank: ExpertBank, fc1: QuantizedWeight, fc2: QuantizedWeight, biases: dict[str, Tensor]) -> None:
        super().__init__()
        if bank.ep_group is not None:
            raise ValueError("QuantizedExpertBank: quantize a full bank, not an expert-parallel shard")
        self.num_experts = bank.num_experts
        self.in_features = bank.in_features
        self.hidden_features = bank.hidden_features
        self.out_features = bank.out_features
        self.gated = bank.gated
        self.act = bank.act
        self.fc1 = fc1
        self.fc2 = fc2
        for name in ("fc1_bias", "fc2_bias"):
            self.register_buffer(name, biases.get(name))

    @property
    def fmt(self) -> QuantFormat:
        return self.fc1.fmt

    def padding(self, counts: Tensor, x: Tensor) -> None:
        """:meth:`moekit.moe.ExpertBank.padding`: None, each expert runs on its ragged rows."""
        return None

    def reads_counts_on_host(self, x: Tensor) -> bool:
        """:meth:`moekit.moe.ExpertBank.reads_counts_on_host`: False, the dispatch hands over every row."""
        return False

    def forward(self, x: Tensor, group_sizes: GroupSizes, no_tail: bool = False) -> Tensor:
        """:meth:`moekit.moe.ExpertBank.forward`'s contract (``no_tail`` changes nothing here: the loop writes
        the groups' rows into zeros)."""
        device_type = x.device.type
        dtype = compute_dtype(x)
        x = x.to(dtype)
        sizes = [group_sizes] * self.num_experts if isinstance(group_sizes, int) else group_sizes.tolist()
        out = x.new_zeros(x.shape[0], self.out_features)
        start = 0
        with torch.autocast(device_type, enabled=False):
            for e, rows in enumerate(sizes):
                if rows:
                    x_e = x[start : start + rows]  # [rows, in]
                    h = x_e @ self.fc1.dequantize(e, dtype)
                    if self.fc1_bias is not None:
                        h = h + self.fc1_bias[e].to(dtype)
                    h = expert_activation(h, self.act, self.gated)  # [rows, hidden]
                    y = h @ self.fc2.dequantize(e, dtype)
                    if self.fc2_bias is not None:
                        y = y + self.fc2_bias[e].to(dtype)
                    out[start : start + rows] = y
                start += rows
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, {self.in_features}->{self.hidden_features}->{self.out_features}"
