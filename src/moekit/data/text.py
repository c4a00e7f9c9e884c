"""Text data for language modelling: ``TextDataModule`` and its datasets (the corpora:
:mod:`moekit.data.corpora`; the tokenizers: :mod:`moekit.data.tokenizers`).

``TextDataModule`` tokenizes the whole corpus once into one token stream, splits it into contiguous
train / val / test parts and yields ``(inputs [B, seq_len] int64, targets [B, seq_len] int64)`` with
``targets`` = ``inputs`` shifted by one token: packed windows of the stream (:class:`TokenWindows`), or with
``pack=False`` windows of one document each, padded, with a third element, the padding mask
(:class:`DocumentWindows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from .corpora import PathLike, check_source_args, load_corpus
from .resumable import ResumableTrainOrderMixin
from .tokenizers import TOKENIZER_KEYS, build_tokenizer, document_bytes, encode_corpus

__all__ = ["PAD_TARGET", "DocumentWindows", "TextDataModule", "TokenWindows", "split_bytes"]

PAD_TARGET = -100
"""The target of a padding position (``F.cross_entropy``'s default ``ignore_index``)."""


# --- datasets and the DataModule -----------------------------------------------------------------


def split_bytes(document_bytes: Tensor, lengths: Tensor, start: int, end: int) -> float:
    """UTF-8 bytes of the text that tokens ``[start, end)`` of the stream encode: the documents' own byte counts
    (``document_bytes [D]``, each with its separator), not a decoding of the tokens, which adds spaces where a
    tokenizer has no decoder (WordLevel, WordPiece) and would count bytes that the text lacks. A document the split's
    boundary cuts counts the share of its bytes that its tokens on this side hold. ``lengths [D]``: each document's
    tokens (:func:`~moekit.data.tokenizers.encode_corpus`)."""
    ends = lengths.cumsum(0)
    inside = (ends.clamp(max=end) - (ends - lengths).clamp(min=start)).clamp(min=0)  # [D] tokens in the split
    return float((inside.double() * document_bytes / lengths.clamp(min=1).double()).sum())


def _documents_within(starts: list[int], ends: list[int], low: int, high: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` ranges of the documents clipped to the token range ``[low, high)`` (empty ones left out)."""
    return [(max(s, low), min(e, high)) for s, e in zip(starts, ends) if min(e, high) > max(s, low)]


class TokenWindows(Dataset):
    """Non-overlapping windows of a token stream: item ``i`` is ``(inputs [seq_len], targets [seq_len])`` int64.

    Window ``i`` reads ``tokens[i * seq_len : (i + 1) * seq_len + 1]``: ``inputs`` are its first ``seq_len``
    tokens, ``targets`` its last ``seq_len`` (the next token of each input). Every token after the first
    is a target exactly once; there are ``(len(tokens) - 1) // seq_len`` windows and the incomplete
    tail (fewer than ``seq_len`` targets) is dropped.
    """

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"TokenWindows: tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens.long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class DocumentWindows(Dataset):
    """Windows of one document each: item ``i`` is ``(inputs [seq_len], targets [seq_len], padding_mask [seq_len])``.

    ``documents`` are ``(start, end)`` token ranges of ``tokens`` (a document's trailing separator included). A
    document of ``n`` tokens has ``n - 1`` targets, cut into ``ceil((n - 1) / seq_len)`` windows of stride
    ``seq_len``; the last one is padded at its end: inputs ``0``, targets :data:`PAD_TARGET`, ``padding_mask``
    False. Every token of a document after its first is a target exactly once, and no window crosses from one
    document into the next (documents of one token have no target and no window).
    """

    def __init__(self, tokens: Tensor, documents: Sequence[tuple[int, int]], seq_len: int) -> None:
        self.tokens = tokens.long()
        self.seq_len = seq_len
        self.windows = [  # (first input, end of the document)
            (first, end) for start, end in documents for first in range(start, end - 1, seq_len)
        ]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        first, end = self.windows[index]
        window = self.tokens[first : min(first + self.seq_len + 1, end)]
        real = len(window) - 1
        inputs = torch.zeros(self.seq_len, dtype=torch.long)
        targets = torch.full((self.seq_len,), PAD_TARGET, dtype=torch.long)
        inputs[:real], targets[:real] = window[:-1], window[1:]
        return inputs, targets, torch.arange(self.seq_len) < real


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_fraction(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1


class TextDataModule(ResumableTrainOrderMixin, L.LightningDataModule):
    """Language-modelling loaders of ``(inputs [B, seq_len] int64, targets [B, seq_len] int64)`` (and, with
    ``pack=False``, ``padding_mask [B, seq_len]`` bool).

    The corpus (:func:`load_corpus`) is tokenized once, documents joined with ``"\\n\\n"``, into one
    token stream of ``N`` tokens. The splits are contiguous and in order: the first
    ``N - n_val - n_test`` tokens are train, the next ``n_val = floor(val_fraction * N)`` val, the last
    ``n_test = floor(test_fraction * N)`` test. Each split is cut into its own non-overlapping windows
    (:class:`TokenWindows`, stride ``seq_len``, the incomplete tail dropped), so no window, input or
    target, crosses a split boundary. Train windows are shuffled (seeded) every epoch; val / test are in order.

    With ``pack=False`` no window holds two documents: each document of a split (a document the split boundary
    cuts counts as two) has its own windows, the last one padded (:class:`DocumentWindows`), and batches carry the
    padding mask, which the models take so that padding changes nothing for the real tokens. The splits, and so
    the held-out tokens, are the same as packed.

    Args:
        source, paths, hf_dataset, text_column: the corpus, see :func:`load_corpus` ("pydoc": offline).
        tokenizer: keywords of :func:`build_tokenizer` (``kind``, ``path``, ``vocab_file``,
            ``merges_file``); None: the byte tokenizer.
        vocab_size: the value the config expects (the model reads ``${data.vocab_size}``); a tokenizer
            of another size is an error. None: no check.
        seq_len: tokens per sequence (inputs and targets each).
        pack: windows of the joined token stream (documents run into each other, no padding) or, False, windows
            of one document each, padded to ``seq_len``.
        batch_size: training batch size.
        eval_batch_size: val / test batch size (default ``batch_size``).
        val_fraction, test_fraction: fractions of the token stream held out, each in ``[0, 1)``, their sum
            below 1. 0: no such split (its loader is an empty list: Lightning skips validation / testing).
        num_workers: DataLoader worker processes (persistent when > 0).
        pin_memory: DataLoader ``pin_memory``.
        drop_last: drop the last incomplete training batch.
        seed: seeds the training shuffle (Hydra: ``${oc.select:seed,0}``).

    After ``setup()``: ``tokens`` (the whole stream ``[N]`` int64), ``split_tokens`` (name -> ``[n]``
    int64), ``train_set`` / ``val_set`` / ``test_set`` (:class:`TokenWindows`; with ``pack=False``
    :class:`DocumentWindows`) and ``bytes_per_token``
    (split name -> UTF-8 bytes of the split's text / its tokens, :func:`split_bytes`; 1.0 for the byte tokenizer;
    non-empty splits only). Bits per byte = mean next-token loss in nats / ln 2 / ``bytes_per_token``.
    ``tokenizer``, ``vocab_size`` and ``seq_len`` are set by ``__init__``.
    """

    def __init__(
        self,
        source: str = "pydoc",
        paths: PathLike | Sequence[PathLike] | None = None,
        hf_dataset: PathLike | None = None,
        text_column: str = "text",
        tokenizer: Mapping | None = None,
        vocab_size: int | None = None,
        seq_len: int = 256,
        pack: bool = True,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        check_source_args(source, paths, hf_dataset)
        if not (_is_int(seq_len) and seq_len >= 1):
            raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
        if not isinstance(pack, bool):
            raise ValueError(f"pack={pack!r} must be true (windows of the token stream) or false (one document each)")
        for name, value in (("drop_last", drop_last), ("pin_memory", pin_memory)):
            if not isinstance(value, bool):  # data.drop_last=no is the string 'no', which a loader takes as true
                raise ValueError(f"{name}={value!r} must be true or false")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if value is not None and not (_is_int(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not (_is_int(num_workers) and num_workers >= 0):
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0")
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not _is_fraction(value):
                raise ValueError(f"{name}={value!r} must be a fraction in [0, 1) (0: no {name.split('_')[0]} split)")
        if val_fraction + test_fraction >= 1:
            raise ValueError(
                f"val_fraction={val_fraction} + test_fraction={test_fraction} = {val_fraction + test_fraction:g} "
                "leaves no training data; their sum must be below 1"
            )
        tokenizer_kwargs = dict(tokenizer) if tokenizer is not None else {}
        unknown = sorted(set(tokenizer_kwargs) - set(TOKENIZER_KEYS))
        if unknown:
            raise ValueError(f"tokenizer keys {unknown} are not supported; use {list(TOKENIZER_KEYS)}")
        self.save_hyperparameters()

        self.tokenizer = build_tokenizer(**tokenizer_kwargs)
        if vocab_size is not None and vocab_size != self.tokenizer.vocab_size:
            size = self.tokenizer.vocab_size
            raise ValueError(
                f"data.vocab_size={vocab_size} but tokenizer {self.tokenizer.name!r} has {size} tokens; "
                f"set data.vocab_size={size} (the model reads it through ${{data.vocab_size}})"
            )
        self.vocab_size = self.tokenizer.vocab_size
        self.seq_len = seq_len
        self.pack = pack
        self.source, self.paths, self.hf_dataset, self.text_column = source, paths, hf_dataset, text_column
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.seed = seed
        # Set by setup().
        self.tokens: Tensor | None = None
        self.split_tokens: dict[str, Tensor] = {}
        self.bytes_per_token: dict[str, float] = {}
        self.train_set: TokenWindows | DocumentWindows | None = None
        self.val_set: TokenWindows | DocumentWindows | None = None
        self.test_set: TokenWindows | DocumentWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read and tokenize the corpus and build all three splits (whatever ``stage``); later calls do nothing."""
        if self.train_set is not None:
            return
        documents = load_corpus(self.source, self.paths, self.hf_dataset, self.text_column)
        tokens, lengths = encode_corpus(self.tokenizer, documents)
        n = len(tokens)
        n_val, n_test = int(self.val_fraction * n), int(self.test_fraction * n)
        bounds = {"train": (0, n - n_val - n_test), "val": (n - n_val - n_test, n - n_test), "test": (n - n_test, n)}
        fractions = {
            "train": 1 - self.val_fraction - self.test_fraction,
            "val": self.val_fraction,
            "test": self.test_fraction,
        }
        split_tokens: dict[str, Tensor] = {}
        for split, (start, end) in bounds.items():
            if fractions[split] == 0:
                split_tokens[split] = tokens[:0]
                continue
            if end - start < self.seq_len + 1:
                resize = "smaller val_fraction / test_fraction" if split == "train" else f"larger {split}_fraction"
                raise ValueError(
                    f"the {split} split has {end - start} tokens ({fractions[split]:g} of the {n} tokens of the "
                    f"corpus), fewer than seq_len + 1 = {self.seq_len + 1}; use a smaller seq_len, a {resize}, "
                    "or more data"
                )
            split_tokens[split] = tokens[start:end]
        self.tokens, self.split_tokens = tokens, split_tokens
        sizes = document_bytes(documents).double()
        self.bytes_per_token = {
            split: split_bytes(sizes, lengths, *bounds[split]) / len(part)
            for split, part in split_tokens.items()
            if len(part) > 0
        }
        if self.pack:
            self.val_set, self.test_set, self.train_set = (
                TokenWindows(split_tokens[split], self.seq_len) for split in ("val", "test", "train")
            )
            return
        ends = lengths.cumsum(0)
        starts = (ends - lengths).tolist()
        self.val_set, self.test_set, self.train_set = (
            DocumentWindows(tokens, _documents_within(starts, ends.tolist(), *bounds[split]), self.seq_len)
            for split in ("val", "test", "train")
        )

    def _require_setup(self) -> None:
        if self.train_set is None:
            self.setup()

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool, drop_last: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            # resumable mid-epoch (moekit.data.resumable); its own generator: iterating draws nothing global
            sampler=self._train_sampler_for(len(dataset), batch_size, self.seed) if shuffle else None,
            drop_last=drop_last,
            generator=torch.Generator().manual_seed(self.seed),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled windows (seeded generator: a new order each epoch, the same sequence for the same seed)."""
        self._require_setup()
        if self.drop_last and len(self.train_set) < self.batch_size:
            raise ValueError(
                f"the train split has {len(self.train_set)} windows of seq_len={self.seq_len}, fewer than "
                f"batch_size={self.batch_size}, so drop_last=True leaves no batch; use a smaller batch_size or "
                "seq_len, more data, or drop_last=false"
            )
        return self._loader(self.train_set, self.batch_size, shuffle=True, drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader | list:
        """The val windows in order; an empty list (Lightning then skips validation) when ``val_fraction`` is 0."""
        self._require_setup()
        if len(self.val_set) == 0:
            return []
        return self._loader(self.val_set, self.eval_batch_size, shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader | list:
        """The test windows in order; an empty list (Lightning then runs no test batch) when ``test_fraction`` is 0."""
        self._require_setup()
        if len(self.test_set) == 0:
            return []
        return self._loader(self.test_set, self.eval_batch_size, shuffle=False, drop_last=False)
