"""Sub-2-bit storage of ternary weights: a Tunstall code, fixed-length codewords for variable-length runs.

QMoE (Frantar & Alistarh 2023) stores ternary expert weights with a dictionary of fixed-length codewords,
each standing for a run of ternary symbols: ternary weights of large MoEs are mostly zeros, so a codeword
covers many of them, and fixed-length codewords can be decoded in parallel. We build the dictionary as a
Tunstall code (Tunstall 1967), the optimal variable-to-fixed code of a memoryless source: starting from the three
one-symbol words, repeatedly replace the most probable word ``w`` by ``w0, w1, w2`` while the words fit in ``2^bits``
codewords (each expansion adds two: ``2^bits - 1`` words, 255 or 65535). The dictionary follows from the three symbol
counts alone, so a file stores those counts, not the dictionary; every reader rebuilds the same dictionary (float64
products, ties broken by creation order).

Layout. A weight's symbols (one expert's ``[in, out]`` codes, row-major) are cut into chunks of
:data:`CHUNK` symbols (the last of each expert may be shorter) that are encoded independently: the encoder
parses all chunks in parallel, one symbol per step, and a chunk ends with any codeword extending its
unfinished word (the decoder keeps only the chunk's share of that word's symbols). ``codewords`` holds the
chunks one after the other, ``chunk_offsets [chunks + 1]`` where each starts. A decoder looks every
codeword up in a padded table of the words and keeps each word's length of its row: two gathers and a mask.

Codewords are 8 or 16 bits, whichever makes the weight smaller counting the decoding table a reader holds
in memory (:func:`choose_code`): small weights do better with 8-bit codewords.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "CHUNK",
    "TunstallCode",
    "build_code",
    "choose_code",
    "chunk_lengths",
    "chunk_ends",
    "encode",
    "decode",
    "entropy_bits",
]

CHUNK = 4096


@dataclass
class TunstallCode:
    """A Tunstall dictionary over ``{0, 1, 2}`` and the tables that encode and decode with it."""

    counts: tuple[int, int, int]
    bits: int
    child: Tensor  # [nodes, 3] int64: the node a symbol leads to (internal nodes; -1 below leaves)
    leaf_code: Tensor  # [nodes] int64: a leaf's codeword, -1 for internal nodes
    finish: Tensor  # [nodes] int64: a codeword whose word extends the node's (ends an unfinished chunk)
    table: Tensor  # [codewords, longest word] uint8: each codeword's word, zero-padded
    lengths: Tensor  # [codewords] int64: the words' lengths
    mean_length: float  # expected symbols per codeword under the counts' frequencies

    def table_bytes(self) -> int:
        """Bytes a decoder holds in memory for this code."""
        return sum(t.numel() * t.element_size() for t in (self.table, self.lengths))


def _grow(counts: tuple[int, int, int], bits: int) -> tuple[list, list, list, list, dict[int, list[int]]]:
    """The Tunstall tree: node 0 is the root; node n has ``parent[n]``, ``symbol[n]`` (the last symbol of its word),
    ``prob[n]`` and ``depth[n]``; ``children`` maps each internal node to its three children (creation order)."""
    if bits not in (8, 16):
        raise ValueError(f"codeword bits={bits} must be 8 or 16")
    total = sum(counts) + 3
    probs = [(c + 1) / total for c in counts]
    size = 2**bits
    parent, symbol, prob, depth = [-1], [0], [1.0], [0]
    children: dict[int, list[int]] = {}
    heap: list[tuple[float, int]] = []

    def expand(node: int) -> None:
        kids = []
        for s in range(3):
            parent.append(node)
            symbol.append(s)
            prob.append(prob[node] * probs[s])
            depth.append(depth[node] + 1)
            kids.append(len(parent) - 1)
            heapq.heappush(heap, (-prob[-1], kids[-1]))
        children[node] = kids

    expand(0)
    leaves = 3
    while leaves + 2 <= size:
        _, node = heapq.heappop(heap)
        expand(node)
        leaves += 2
    return parent, symbol, prob, depth, children


def build_code(counts: tuple[int, int, int] | Tensor, bits: int) -> TunstallCode:
    """The Tunstall code of ``2^bits - 1`` codewords (all that fit in ``bits``) for symbol counts ``counts``
    (add-one smoothed)."""
    counts = tuple(int(c) for c in (counts.tolist() if isinstance(counts, Tensor) else counts))
    parent, symbol, prob, depth, children = _grow(counts, bits)
    nodes = len(parent)
    parent_t, symbol_t, depth_t = (torch.tensor(v, dtype=torch.int64) for v in (parent, symbol, depth))
    child = torch.full((nodes, 3), -1, dtype=torch.int64)
    child[torch.tensor(list(children))] = torch.tensor(list(children.values()))
    is_leaf = child[:, 0] < 0
    is_leaf[0] = False
    leaf_nodes = is_leaf.nonzero().squeeze(1)  # in creation order
    leaf_code = torch.full((nodes,), -1, dtype=torch.int64)
    leaf_code[leaf_nodes] = torch.arange(leaf_nodes.numel())
    finish = leaf_code.clone()
    for d in range(int(depth_t.max()) - 1, -1, -1):  # deepest first: an internal node takes its first child's
        level = ((depth_t == d) & ~is_leaf).nonzero().squeeze(1)
        finish[level] = finish[child[level, 0]]
    # The words, written from their last symbol back to their first, all leaves at once.
    lengths = depth_t[leaf_nodes]
    table = torch.zeros(leaf_nodes.numel(), int(lengths.max()), dtype=torch.uint8)
    rows, node, pos = torch.arange(leaf_nodes.numel()), leaf_nodes.clone(), lengths - 1
    while bool((node > 0).any()):
        live = node > 0
        table[rows[live], pos[live]] = symbol_t[node[live]].to(torch.uint8)
        node = torch.where(live, parent_t[node], node)
        pos = pos - 1
    mean_length = float((torch.tensor(prob, dtype=torch.float64)[leaf_nodes] * lengths).sum())
    return TunstallCode(counts, bits, child, leaf_code, finish, table, lengths, mean_length)


def entropy_bits(counts: tuple[int, int, int] | Tensor) -> float:
    """Empirical entropy of the symbols, bits per symbol: the bound no code of a memoryless source beats."""
    counts = [int(c) for c in (counts.tolist() if isinstance(counts, Tensor) else counts)]
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts if c)


def choose_code(counts: tuple[int, int, int] | Tensor, num_symbols: int) -> TunstallCode:
    """The 8- or 16-bit code that stores ``num_symbols`` symbols in the fewest bytes, its table included. The sizes
    come from the two dictionaries' trees; only the chosen code's table is built."""

    counts = tuple(int(c) for c in (counts.tolist() if isinstance(counts, Tensor) else counts))

    def cost(bits: int) -> float:  # from the tree alone: the padded table of a near-constant source is gigabytes
        _, _, prob, depth, children = _grow(counts, bits)
        leaves = [n for n in range(1, len(depth)) if n not in children]
        mean_length = float((torch.tensor(prob, dtype=torch.float64)[leaves] * torch.tensor(depth)[leaves]).sum())
        table_bytes = len(leaves) * (max(depth[n] for n in leaves) + 8)  # uint8 words, int64 lengths
        return num_symbols * bits / 8 / mean_length + table_bytes

    return build_code(counts, min((8, 16), key=cost))


def chunk_lengths(stream_len: int) -> Tensor:
    """The lengths of the chunks one stream of ``stream_len`` symbols is cut into."""
    full, rest = divmod(stream_len, CHUNK)
    return torch.tensor([CHUNK] * full + ([rest] if rest else []), dtype=torch.int64)


def encode(symbols_SN: Tensor, code: TunstallCode) -> tuple[Tensor, Tensor]:
    """Encode ``S`` streams of ``N`` symbols (uint8 in ``{0, 1, 2}``), each cut into chunks.

    Returns ``(codewords, chunk_offsets)``: codewords (uint8 for 8-bit codes, int16 holding the 16 bits
    otherwise) of all chunks in order, and ``[chunks + 1]`` int64 offsets.
    """
    S, N = symbols_SN.shape
    lengths = chunk_lengths(N).repeat(S)
    padded = torch.nn.functional.pad(symbols_SN, (0, -N % CHUNK)).view(-1, CHUNK).long()  # [chunks, CHUNK]
    chunks = padded.shape[0]
    rows = torch.arange(chunks)
    node = torch.zeros(chunks, dtype=torch.int64)
    count = torch.zeros(chunks, dtype=torch.int64)  # codewords emitted; <= t at step t
    out = torch.empty(chunks, CHUNK, dtype=torch.int64)
    for t in range(CHUNK):
        node = torch.where(lengths > t, code.child[node, padded[:, t]], node)
        word = code.leaf_code[node]  # -1 unless a word ended (a finished chunk stays at an internal node)
        out[rows, count] = word  # a -1 is overwritten by the chunk's next word
        done = word >= 0
        count += done
        node = node.masked_fill(done, 0)
    open_ = node > 0  # unfinished words: any codeword extending them
    out[rows[open_], count[open_]] = code.finish[node[open_]]
    count += open_
    codewords = out[torch.arange(CHUNK) < count.unsqueeze(1)]
    offsets = torch.cat([count.new_zeros(1), count.cumsum(0)])
    stored = codewords.to(torch.uint8) if code.bits == 8 else codewords.to(torch.int16)
    return stored, offsets


def chunk_ends(codewords: Tensor, chunk_offsets: Tensor, lengths: Tensor, code: TunstallCode) -> Tensor:
    """How many symbols of each chunk's last codeword belong to the chunk (its word may run past the chunk's
    end): ``[chunks]``, from the codewords and the chunks' ``lengths``."""
    words = _words(codewords)
    word_lengths = code.lengths[words]
    chunk_of_word = torch.repeat_interleave(torch.arange(lengths.numel()), chunk_offsets.diff())
    decoded = torch.zeros_like(lengths).index_add_(0, chunk_of_word, word_lengths)  # symbols each chunk decodes to
    return word_lengths[chunk_offsets[1:] - 1] - (decoded - lengths)


def _words(codewords: Tensor) -> Tensor:
    words = codewords.long()
    return words & 0xFFFF if codewords.dtype == torch.int16 else words  # int16 holds unsigned 16-bit codewords


def decode(codewords: Tensor, last_word: Tensor, last_length: Tensor, table: Tensor, lengths: Tensor) -> Tensor:
    """The symbols (uint8) of some whole chunks, one after the other.

    Args:
        codewords: the chunks' codewords.
        last_word: ``[chunks]`` the index in ``codewords`` of each chunk's last codeword;
        last_length: how many of its symbols belong to the chunk (:func:`chunk_ends`).
        table, lengths: the code's padded words and their lengths.
    """
    words = _words(codewords)
    keep = lengths[words]
    keep[last_word] = last_length
    return table[words][torch.arange(table.shape[1], device=words.device) < keep.unsqueeze(1)]
