"""Tokenizers for the language models (all have ``vocab_size``, ``encode(text) -> list[int]``, ``decode(ids) -> str``
and ``name``), and the token stream of a list of documents:

- ``ByteTokenizer``: the UTF-8 bytes, 256 tokens, nothing to download (the default);
- ``FileTokenizer``: a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``);
- ``GPT2Tokenizer``: GPT-2's byte-level BPE from its ``vocab.json`` + ``merges.txt``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DOCUMENT_SEPARATOR",
    "TOKENIZER_KEYS",
    "TOKENIZER_KINDS",
    "ByteTokenizer",
    "FileTokenizer",
    "GPT2Tokenizer",
    "TextTokenizer",
    "build_tokenizer",
    "document_bytes",
    "encode_corpus",
]

TOKENIZER_KINDS = ("byte", "file", "gpt2")
TOKENIZER_KEYS = ("kind", "path", "vocab_file", "merges_file")  # keywords of build_tokenizer
DOCUMENT_SEPARATOR = "\n\n"
GPT2_END_OF_TEXT = "<|endoftext|>"

PathLike = str | os.PathLike[str]


@runtime_checkable
class TextTokenizer(Protocol):
    """What ``TextDataModule`` needs of a tokenizer."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _id_list(ids: Sequence[int]) -> list[int]:
    """``ids`` (a list, a numpy array or a tensor) as a list of Python ints."""
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids ``0..255``, ``vocab_size`` 256, one token per byte.

    ``decode`` replaces invalid UTF-8 (e.g. a multi-byte character cut in half) with U+FFFD.
    """

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """The bytes of ``text`` as ``[n_bytes]`` uint8, without a Python loop."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def hf_backend(self):
        """This tokenizer as a ``tokenizers.Tokenizer`` (for a transformers folder): byte-level BPE without merges
        whose 256 symbols stand for the bytes with GPT-2's byte-to-character map, so byte ``b`` is id ``b``."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in enumerate(_byte_characters())}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return backend

    def decode(self, ids: Sequence[int]) -> str:
        array = np.asarray(_id_list(ids), dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() > 255):
            bad = array[(array < 0) | (array > 255)][0]
            raise ValueError(f"ByteTokenizer.decode: id {bad} is not a byte (ids must be in 0..255)")
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _byte_characters() -> list[str]:
    """GPT-2's byte-level alphabet: byte ``b`` -> a printable character (the printable Latin-1 bytes stand for
    themselves, the others for code points from 256 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


class _BackendTokenizer:
    """A tokenizer backed by a ``tokenizers.Tokenizer`` (``self.backend``).

    ``encode`` adds no special tokens (no post-processor template: the corpus is one token stream) and neither
    truncates nor pads, whatever the file sets (a ``tokenizer.json`` saved with truncation would cut every document
    to its ``max_length``, and padding would put pad tokens into the corpus); ``decode`` keeps special tokens, so
    ``decode(encode(text)) == text`` for lossless (byte-level) models. ``backend`` stays as given (what an export
    writes).
    """

    name: str

    def __init__(self, backend) -> None:
        self.backend = backend
        self._encoder = backend
        if backend.truncation is not None or backend.padding is not None:
            from tokenizers import Tokenizer

            self._encoder = Tokenizer.from_str(backend.to_str())
            self._encoder.no_truncation()
            self._encoder.no_padding()

    @property
    def vocab_size(self) -> int:
        """Model vocabulary plus added tokens: every id ``encode`` can return is below it (the largest id + 1, which
        exceeds the count of tokens where a vocabulary skips ids)."""
        ids = self.backend.get_vocab(with_added_tokens=True).values()
        return max(self.backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        return self._encoder.encode(text, add_special_tokens=False).ids

    def hf_backend(self):
        """This tokenizer as a ``tokenizers.Tokenizer`` (for a transformers folder)."""
        return self.backend

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(text) for text in texts]``, encoded in parallel by ``tokenizers``."""
        # encode_batch_fast (tokenizers >= 0.20) skips the offsets, which are not needed here.
        encode = getattr(self._encoder, "encode_batch_fast", self._encoder.encode_batch)
        encodings = encode(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(_id_list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


def _require_file(value: object, what: str, fix: str) -> Path:
    if value is None:
        raise ValueError(f"{what} is not set; {fix}")
    path = Path(os.fspath(value)).expanduser()
    if not path.is_file():
        state = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"{what}={str(value)!r} {state}; {fix}")
    return path


class FileTokenizer(_BackendTokenizer):
    """A Hugging Face ``tokenizers`` JSON file (what ``tokenizers.Tokenizer.save`` writes, ``tokenizer.json``).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not a valid tokenizers JSON (the message carries the parser's error).
    """

    def __init__(self, path: PathLike) -> None:
        from tokenizers import Tokenizer

        fix = "point it at a tokenizer.json written by tokenizers.Tokenizer.save (Hydra: data.tokenizer.path=...)"
        file = _require_file(path, "tokenizer path", fix)
        try:
            backend = Tokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception for I/O and JSON errors
            raise ValueError(
                f"tokenizer path={str(path)!r} is not a valid tokenizers JSON file ({err}); {fix}"
            ) from err
        super().__init__(backend)
        self.path = file
        self.name = f"file:{file}"


class GPT2Tokenizer(_BackendTokenizer):
    """GPT-2's byte-level BPE from the ``vocab.json`` (token -> id) and ``merges.txt`` files of the model.

    Set up as GPT-2's own tokenizer: BPE without unknown token, byte-level pre-tokenizer (GPT-2's regex,
    ``add_prefix_space=False``) and byte-level decoder; ``<|endoftext|>``, when in the vocabulary, is
    a special token (the text ``"<|endoftext|>"`` encodes to its single id, 50256 for GPT-2).
    With GPT-2's files ``vocab_size`` is 50257.

    Raises:
        FileNotFoundError: either file is missing.
        ValueError: the files cannot be parsed as a BPE vocabulary and merges.
    """

    def __init__(self, vocab_file: PathLike, merges_file: PathLike) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        fix = (
            "give GPT-2's vocab.json and merges.txt "
            "(Hydra: data.tokenizer.vocab_file=... data.tokenizer.merges_file=...)"
        )
        vocab = _require_file(vocab_file, "vocab_file", fix)
        merges = _require_file(merges_file, "merges_file", fix)
        try:
            model = models.BPE.from_file(str(vocab), str(merges))
        except Exception as err:  # tokenizers raises a bare Exception for I/O and parse errors
            raise ValueError(
                f"vocab_file={str(vocab_file)!r} / merges_file={str(merges_file)!r} are not a BPE vocab.json + "
                f"merges.txt pair ({err}); {fix}"
            ) from err
        backend = Tokenizer(model)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        if backend.token_to_id(GPT2_END_OF_TEXT) is not None:
            backend.add_special_tokens([GPT2_END_OF_TEXT])
        super().__init__(backend)
        self.vocab_file, self.merges_file = vocab, merges
        self.name = f"gpt2:{vocab}"


def build_tokenizer(
    kind: str = "byte",
    path: PathLike | None = None,
    vocab_file: PathLike | None = None,
    merges_file: PathLike | None = None,
) -> ByteTokenizer | FileTokenizer | GPT2Tokenizer:
    """The tokenizer of ``kind``: "byte" (no files), "file" (``path``) or "gpt2" (``vocab_file`` + ``merges_file``).

    Raises:
        ValueError: unknown ``kind``, a file argument that ``kind`` does not use, or an invalid file.
        FileNotFoundError: a missing file.
    """
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer kind={kind!r} is not supported; choose one of {list(TOKENIZER_KINDS)}")
    owner = {"path": "file", "vocab_file": "gpt2", "merges_file": "gpt2"}
    for name, value in (("path", path), ("vocab_file", vocab_file), ("merges_file", merges_file)):
        if value is not None and owner[name] != kind:
            raise ValueError(
                f"tokenizer {name}={str(value)!r} is only used by kind={owner[name]!r}, not kind={kind!r}; "
                f"set kind={owner[name]!r} or drop {name}"
            )
    if kind == "byte":
        return ByteTokenizer()
    if kind == "file":
        return FileTokenizer(path)  # type: ignore[arg-type]  # None is reported by FileTokenizer
    return GPT2Tokenizer(vocab_file, merges_file)  # type: ignore[arg-type]


def _pieces(documents: Sequence[str], separator: str) -> list[str]:
    """The documents as ``separator.join(documents)`` lays them out: each but the last with the separator appended."""
    return [document + separator for document in documents[:-1]] + list(documents[-1:])


def document_bytes(documents: Sequence[str], separator: str = DOCUMENT_SEPARATOR) -> Tensor:
    """``[n_documents]`` int64: the UTF-8 bytes of each document in ``separator.join(documents)``, its separator
    included (all but the last), so that the sum is the joined text's size (the byte tokenizer's ``lengths``)."""
    return torch.tensor([len(piece.encode("utf-8")) for piece in _pieces(documents, separator)], dtype=torch.long)


def encode_corpus(
    tokenizer: TextTokenizer, documents: Sequence[str], separator: str = DOCUMENT_SEPARATOR
) -> tuple[Tensor, Tensor]:
    """``(tokens [n_tokens], lengths [n_documents])`` int64: the token stream of ``separator.join(documents)`` and
    the tokens of each document in it (its separator included), so that ``lengths.sum() == n_tokens``.

    ``ByteTokenizer`` encodes the joined text in one ``numpy.frombuffer``; tokenizers with
    ``encode_batch`` (``FileTokenizer``, ``GPT2Tokenizer``) encode the documents in parallel, each
    with the separator appended (all but the last), so no token spans two documents; any other
    tokenizer is called once per document the same way.
    """
    pieces = _pieces(documents, separator)
    if isinstance(tokenizer, ByteTokenizer):
        lengths = document_bytes(documents, separator)
        return torch.from_numpy(tokenizer.encode_array(separator.join(documents)).astype(np.int64)), lengths
    if hasattr(tokenizer, "encode_batch"):
        encoded = tokenizer.encode_batch(pieces)
    else:
        encoded = [tokenizer.encode(piece) for piece in pieces]
    arrays = [np.asarray(ids, dtype=np.int64) for ids in encoded]
    lengths = torch.tensor([len(array) for array in arrays], dtype=torch.long)
    return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)), lengths
