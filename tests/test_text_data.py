"""The language-modelling data layer: tokenizers, corpora, token windows and ``TextDataModule``."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from moekit.data import (
    PAD_TARGET,
    ByteTokenizer,
    DocumentWindows,
    FileTokenizer,
    GPT2Tokenizer,
    TextDataModule,
    TokenWindows,
    build_tokenizer,
    encode_corpus,
    load_corpus,
)
from moekit.data.text import split_bytes
from moekit.data.tokenizers import document_bytes

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "data"
BPE_VOCAB = 400
END_OF_TEXT = "<|endoftext|>"
SAMPLE = "Grüße, naïve café — 東京 🚀!\nline two\ttabs  and   spaces " + END_OF_TEXT + " after"


@pytest.fixture(scope="module")
def pydoc_documents() -> list[str]:
    return load_corpus("pydoc")


@pytest.fixture(scope="module")
def trained_bpe(pydoc_documents):
    """A tiny byte-level BPE (GPT-2's pre-tokenizer) trained on the first pydoc topics."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        pydoc_documents[:10], vocab_size=BPE_VOCAB, min_frequency=2, special_tokens=[END_OF_TEXT], show_progress=False
    )
    return tokenizer


@pytest.fixture(scope="module")
def bpe_files(trained_bpe, tmp_path_factory) -> dict[str, Path]:
    """The trained BPE saved as a tokenizer.json and as GPT-2's vocab.json + merges.txt pair."""
    folder = tmp_path_factory.mktemp("bpe")
    trained_bpe.save(str(folder / "tokenizer.json"))
    vocab, merges = trained_bpe.save_model(str(folder))
    return {"json": folder / "tokenizer.json", "vocab": Path(vocab), "merges": Path(merges)}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def make_files_module(folder: Path, **kwargs) -> TextDataModule:
    kwargs = {"source": "files", "paths": str(folder), "seq_len": 8, "batch_size": 4, **kwargs}
    return TextDataModule(**kwargs)


@pytest.fixture
def small_corpus(tmp_path) -> Path:
    """~4 kB of ASCII in 3 files: every split of a 10/10/80 cut holds a few 8-token windows."""
    words = " ".join(f"word{i % 37}" for i in range(700))
    for index in range(3):
        write(tmp_path / "corpus" / f"part{index}.txt", f"file {index}: {words[index * 1000 : (index + 1) * 1300]}")
    return tmp_path / "corpus"


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_non_ascii():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and len(ids) > len(SAMPLE)  # multi-byte characters
    assert tokenizer.decode(ids) == SAMPLE
    assert tokenizer.decode(torch.tensor(ids)) == SAMPLE
    assert tokenizer.vocab_size == 256 and max(ids) < 256
    assert tokenizer.decode(ids[:2] + ids[3:4]) == "Gr\ufffd"  # ü cut in half: replaced, not an error
    with pytest.raises(ValueError, match="id 300 is not a byte"):
        tokenizer.decode([65, 300])


def test_file_tokenizer_matches_trained_and_round_trips(trained_bpe, bpe_files):
    tokenizer = build_tokenizer("file", path=str(bpe_files["json"]))
    assert isinstance(tokenizer, FileTokenizer) and tokenizer.vocab_size == BPE_VOCAB
    ids = tokenizer.encode(SAMPLE)
    assert ids == trained_bpe.encode(SAMPLE).ids
    assert len(ids) < len(SAMPLE.encode("utf-8")) / 1.2  # merges were learned
    assert tokenizer.decode(ids) == SAMPLE
    assert ids.count(trained_bpe.token_to_id(END_OF_TEXT)) == 1


def test_a_tokenizer_file_saved_with_truncation_and_padding_encodes_whole_documents(bpe_files, tmp_path):
    """A tokenizer.json saved with truncation (max_length 8) cut every document to 8 tokens, and its padding put pad
    tokens into the corpus (encode_batch pads to the longest document)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(bpe_files["json"]))
    backend.enable_truncation(max_length=8)
    backend.enable_padding(pad_id=0, pad_token=END_OF_TEXT)
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = FileTokenizer(tmp_path / "tokenizer.json")
    plain = FileTokenizer(bpe_files["json"])
    assert tokenizer.encode(SAMPLE) == plain.encode(SAMPLE) and len(plain.encode(SAMPLE)) > 8
    documents = [SAMPLE, "short"]
    tokens, lengths = encode_corpus(tokenizer, documents)
    expected_tokens, expected_lengths = encode_corpus(plain, documents)
    assert torch.equal(tokens, expected_tokens) and torch.equal(lengths, expected_lengths)
    assert tokenizer.decode(tokens) == "\n\n".join(documents)
    assert tokenizer.hf_backend().truncation["max_length"] == 8, "the file's own settings are exported as they are"


def test_gpt2_tokenizer_from_vocab_and_merges_equals_trained(trained_bpe, bpe_files, pydoc_documents):
    tokenizer = build_tokenizer("gpt2", vocab_file=bpe_files["vocab"], merges_file=bpe_files["merges"])
    assert isinstance(tokenizer, GPT2Tokenizer) and tokenizer.vocab_size == BPE_VOCAB
    for text in (SAMPLE, pydoc_documents[-1][:3000], " leading space", "a\n\n\nb"):
        ids = tokenizer.encode(text)
        assert ids == trained_bpe.encode(text).ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode(END_OF_TEXT) == [trained_bpe.token_to_id(END_OF_TEXT)]  # one special token


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"kind": "sentencepiece"}, ValueError, r"kind='sentencepiece' is not supported; choose one of"),
        ({"kind": "file"}, ValueError, r"tokenizer path is not set; point it at a tokenizer.json"),
        ({"kind": "file", "path": "nowhere/tok.json"}, FileNotFoundError, r"path='nowhere/tok.json' does not exist"),
        ({"kind": "byte", "path": "tok.json"}, ValueError, r"path='tok.json' is only used by kind='file'"),
        ({"kind": "gpt2"}, ValueError, r"vocab_file is not set; give GPT-2's vocab.json and merges.txt"),
    ],
)
def test_build_tokenizer_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        build_tokenizer(**kwargs)


def test_a_vocabulary_that_skips_ids_has_room_for_its_largest_id(tmp_path):
    """A tokenizer.json whose vocabulary skips ids (a pruned one): ``vocab_size`` is its largest id + 1, not its count
    of tokens, so that the model's embedding holds every id the corpus encodes to."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1, "b": 2, "z": 7}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    write(tmp_path / "corpus.txt", " ".join("abz"[i % 3] for i in range(300)))
    tokenizer = build_tokenizer("file", path=str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("a z") == [1, 7]
    assert tokenizer.vocab_size == 8
    module = make_files_module(
        tmp_path / "corpus.txt", tokenizer={"kind": "file", "path": str(tmp_path / "tokenizer.json")}
    )
    module.setup()
    assert int(module.tokens.max()) == 7 < module.vocab_size


def test_invalid_tokenizer_files(tmp_path, bpe_files):
    bad_json = write(tmp_path / "bad.json", "{not json")
    with pytest.raises(ValueError, match=rf"path='{re.escape(str(bad_json))}' is not a valid tokenizers JSON"):
        FileTokenizer(bad_json)
    with pytest.raises(FileNotFoundError, match="is a directory, not a file"):
        FileTokenizer(tmp_path)
    bad_vocab = write(tmp_path / "vocab.json", json.dumps(["not", "a", "mapping"]))
    with pytest.raises(ValueError, match=rf"vocab_file='{re.escape(str(bad_vocab))}' .* not a BPE vocab.json"):
        GPT2Tokenizer(bad_vocab, bpe_files["merges"])
    with pytest.raises(FileNotFoundError, match=r"merges_file='.*merges.txt' does not exist"):
        GPT2Tokenizer(bpe_files["vocab"], tmp_path / "merges.txt")


def test_encode_corpus_joins_with_blank_line(bpe_files):
    documents = ["first doc", "second — doc", "third"]
    byte_stream, _ = encode_corpus(ByteTokenizer(), documents)
    assert byte_stream.dtype == torch.int64 and bytes(byte_stream.tolist()) == "\n\n".join(documents).encode()
    tokenizer = FileTokenizer(bpe_files["json"])
    stream, _ = encode_corpus(tokenizer, documents)
    assert stream.dtype == torch.int64 and tokenizer.decode(stream) == "\n\n".join(documents)


# --- corpora ------------------------------------------------------------------------------------


def test_pydoc_corpus_nonempty_and_deterministic(pydoc_documents):
    from pydoc_data.topics import topics

    assert len(pydoc_documents) == len(topics) > 50
    assert sum(map(len, pydoc_documents)) > 100_000
    assert pydoc_documents[0] == topics[min(topics)] and pydoc_documents[-1] == topics[max(topics)]
    assert load_corpus("pydoc") == pydoc_documents


def test_files_source_reads_folders_recursively_in_sorted_order(tmp_path):
    write(tmp_path / "docs" / "b.txt", "B")
    write(tmp_path / "docs" / "a" / "z.md", "AZ")
    write(tmp_path / "docs" / "a" / "c.rst", "AC")
    write(tmp_path / "docs" / "skip.py", "print('not text')")
    write(tmp_path / "docs" / "empty.txt", "")
    single = write(tmp_path / "notes.log", "LOG")  # a file named explicitly is read whatever its suffix
    assert load_corpus("files", paths=str(tmp_path / "docs")) == ["AC", "AZ", "B"]
    assert load_corpus("files", paths=[single, tmp_path / "docs" / "a"]) == ["LOG", "AC", "AZ"]


def test_files_source_reads_a_file_reached_twice_once(tmp_path):
    # named and in a listed folder, or in nested listed folders: read twice, the copy at the end of the stream
    # fell into the test split while the first one was trained on
    a = write(tmp_path / "docs" / "a.txt", "A")
    write(tmp_path / "docs" / "sub" / "b.txt", "B")
    assert load_corpus("files", paths=[tmp_path / "docs", a]) == ["A", "B"]
    assert load_corpus("files", paths=[tmp_path / "docs", tmp_path / "docs" / "sub"]) == ["A", "B"]
    assert load_corpus("files", paths=[a, tmp_path / "docs"]) == ["A", "B"]


def test_files_source_leaves_hidden_files_and_folders_out(tmp_path):
    """A notebook's checkpoint copies and a repository's .git would put copies of documents in other splits."""
    write(tmp_path / "docs" / "a.md", "A")
    write(tmp_path / "docs" / ".ipynb_checkpoints" / "a-checkpoint.md", "A")
    write(tmp_path / "docs" / ".git" / "description.txt", "git")
    write(tmp_path / "docs" / ".draft.txt", "draft")
    write(tmp_path / ".corpus" / "b.txt", "B")  # a hidden folder given by name is read
    assert load_corpus("files", paths=tmp_path / "docs") == ["A"]
    assert load_corpus("files", paths=[tmp_path / ".corpus", tmp_path / "docs" / ".draft.txt"]) == ["B", "draft"]


def test_files_source_drops_a_byte_order_mark(tmp_path):
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello")  # UTF-8 as Windows editors save it
    assert load_corpus("files", paths=bom) == ["hello"]
    tokens, _ = encode_corpus(ByteTokenizer(), load_corpus("files", paths=bom))
    assert tokens.tolist() == list(b"hello")


def test_hf_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": ["first row", None, "", "second row"], "id": [0, 1, 2, 3]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "flat"))
    assert load_corpus("hf", hf_dataset=str(tmp_path / "flat")) == ["first row", "second row"]
    splits = datasets.DatasetDict(
        {
            "test": datasets.Dataset.from_dict({"body": ["held out"]}),
            "train": datasets.Dataset.from_dict({"body": ["x", "y"]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load_corpus("hf", hf_dataset=tmp_path / "dict", text_column="body") == ["x", "y"]  # train split only
    with pytest.raises(ValueError, match=r"text_column='text' is not a column of .* columns are \['body'\]"):
        load_corpus("hf", hf_dataset=tmp_path / "dict")
    with pytest.raises(ValueError, match=r"text_column='id' .* holds int values"):
        load_corpus("hf", hf_dataset=tmp_path / "flat", text_column="id")
    with pytest.raises(FileNotFoundError, match=r"hf_dataset='.*nowhere' does not exist; .*save_to_disk\(path\)"):
        load_corpus("hf", hf_dataset=str(tmp_path / "nowhere"))
    a_file = write(tmp_path / "rows.parquet", "not a dataset folder")
    with pytest.raises(FileNotFoundError, match=r"hf_dataset='.*rows.parquet' is a file, not a folder"):
        load_corpus("hf", hf_dataset=str(a_file))  # was "does not exist"
    with pytest.raises(FileNotFoundError, match=r"is not a dataset saved with save_to_disk"):
        load_corpus("hf", hf_dataset=str(tmp_path))


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match=r"source='web' is not supported"):
        load_corpus("web")
    with pytest.raises(ValueError, match=r"source='files' needs paths="):
        load_corpus("files")
    with pytest.raises(FileNotFoundError, match=r"paths entry '.*missing.txt' does not exist"):
        load_corpus("files", paths=[str(tmp_path / "missing.txt")])
    write(tmp_path / "code" / "main.py", "x = 1")
    with pytest.raises(FileNotFoundError, match=r"folder '.*code' holds no text files"):
        load_corpus("files", paths=str(tmp_path / "code"))
    empty = write(tmp_path / "empty" / "a.txt", "")
    with pytest.raises(ValueError, match=r"the corpus of paths=.*empty.* is empty"):
        load_corpus("files", paths=str(empty.parent))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"'.*latin1.txt' is not valid UTF-8"):
        load_corpus("files", paths=latin1)
    with pytest.raises(ValueError, match=r"paths='a.txt' is only read with source='files'"):
        load_corpus("pydoc", paths="a.txt")


def test_an_empty_path_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path / "notes.md", "not meant as training text")
    monkeypatch.chdir(tmp_path)
    for paths in ("", [str(tmp_path / "notes.md"), " "]):  # data.paths= gives ''; it read every text file below .
        with pytest.raises(ValueError, match=r"paths=.* holds an empty path; give a file or folder"):
            load_corpus("files", paths=paths)


# --- windows and the DataModule -------------------------------------------------------------------


@pytest.mark.parametrize("length", [17, 25, 26])
def test_token_windows_tile_the_split(length):
    tokens = torch.arange(100, 100 + length)
    windows = TokenWindows(tokens, seq_len=8)
    assert len(windows) == (length - 1) // 8
    inputs = torch.cat([windows[i][0] for i in range(len(windows))])
    targets = torch.cat([windows[i][1] for i in range(len(windows))])
    covered = len(windows) * 8
    assert torch.equal(inputs, tokens[:covered]) and torch.equal(targets, tokens[1 : covered + 1])
    assert length - 1 - covered < 8  # only an incomplete tail is dropped
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_encode_corpus_counts_each_documents_tokens(bpe_files):
    documents = ["first doc", "second — doc", "third"]
    for tokenizer in (ByteTokenizer(), FileTokenizer(bpe_files["json"])):
        tokens, lengths = encode_corpus(tokenizer, documents)
        assert int(lengths.sum()) == len(tokens)
        pieces = torch.split(tokens, lengths.tolist())
        assert [tokenizer.decode(piece) for piece in pieces] == ["first doc\n\n", "second — doc\n\n", "third"]
    # each document's own UTF-8 bytes with its separator ("—" is 3 bytes): the byte tokenizer's token counts
    assert document_bytes(documents).tolist() == [11, 16, 5]
    assert torch.equal(document_bytes(documents), encode_corpus(ByteTokenizer(), documents)[1])


def test_document_windows_pad_each_document_and_never_cross():
    tokens = torch.arange(100, 130)
    documents = [(0, 12), (12, 13), (13, 21), (21, 30)]  # 12 tokens, 1 (no target), 8, 9
    windows = DocumentWindows(tokens, documents, seq_len=4)
    assert len(windows) == 3 + 0 + 2 + 2  # ceil((n - 1) / 4)
    seen = []
    for inputs, targets, mask in (windows[i] for i in range(len(windows))):
        assert mask.dtype == torch.bool and torch.equal(mask, targets != PAD_TARGET)
        assert torch.all(inputs[~mask] == 0) and bool(mask[0])
        assert mask.sum() == 4 or not mask[-1]  # padding only at the end
        real_inputs, real_targets = inputs[mask], targets[mask]
        assert torch.equal(real_targets, real_inputs + 1)  # the next token, within one document
        document = next(i for i, (s, e) in enumerate(documents) if s <= int(real_inputs[0]) - 100 < e)
        assert int(real_targets[-1]) - 100 < documents[document][1]
        seen.extend(real_targets.tolist())
    expected = [int(t) for s, e in documents for t in tokens[s + 1 : e]]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))  # every target exactly once


def test_unpacked_module_keeps_the_splits_and_yields_masks(small_corpus):
    packed = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1)
    module = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1, pack=False, drop_last=False)
    packed.setup(), module.setup()
    assert all(torch.equal(packed.split_tokens[s], module.split_tokens[s]) for s in ("train", "val", "test"))
    # train: the three files' pieces in the split, each without its first token, in shuffled windows
    _, lengths = encode_corpus(module.tokenizer, load_corpus("files", paths=str(small_corpus)))
    ends = lengths.cumsum(0).tolist()
    train_end = len(module.split_tokens["train"])
    starts = [0] + [e for e in ends[:-1] if e < train_end]
    expected = Counter(t for s, e in zip(starts, starts[1:] + [train_end]) for t in module.tokens[s + 1 : e].tolist())
    inputs, batch_targets, mask = next(iter(module.train_dataloader()))
    assert mask.shape == inputs.shape == batch_targets.shape == (4, 8) and mask.dtype == torch.bool
    assert Counter(t for b in module.train_dataloader() for t in b[1][b[2]].tolist()) == expected
    # the val split lies inside the last file: its targets are all of its tokens but the first
    val_targets = torch.cat([batch[1][batch[2]] for batch in module.val_dataloader()])
    assert torch.equal(val_targets, module.split_tokens["val"][1:])


def test_pydoc_module_splits_are_contiguous_and_batches_shifted():
    module = TextDataModule(seq_len=32, batch_size=16, eval_batch_size=64)
    assert module.vocab_size == 256 and module.seq_len == 32 and isinstance(module.tokenizer, ByteTokenizer)
    module.setup()
    tokens, parts = module.tokens, module.split_tokens
    n = len(tokens)
    assert tokens.dtype == torch.int64 and n == len("\n\n".join(load_corpus("pydoc")).encode())
    assert torch.equal(torch.cat([parts["train"], parts["val"], parts["test"]]), tokens)  # in order, disjoint, all
    assert len(parts["val"]) == int(0.05 * n) == len(parts["test"])
    assert module.bytes_per_token == {"train": 1.0, "val": 1.0, "test": 1.0}

    inputs, targets = next(iter(module.train_dataloader()))
    assert inputs.shape == targets.shape == (16, 32) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    val_batches = list(module.val_dataloader())
    val_inputs = torch.cat([batch[0] for batch in val_batches]).flatten()
    val_targets = torch.cat([batch[1] for batch in val_batches]).flatten()
    covered = len(val_inputs)
    assert covered == (len(parts["val"]) - 1) // 32 * 32
    assert torch.equal(val_inputs, parts["val"][:covered]) and torch.equal(val_targets, parts["val"][1 : covered + 1])


def test_train_loader_drops_last_and_is_seeded(small_corpus):
    def first_batch(seed: int) -> torch.Tensor:
        module = make_files_module(small_corpus, seed=seed, val_fraction=0.1, test_fraction=0.1)
        return next(iter(module.train_dataloader()))[0]

    module = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1, batch_size=5)
    module.setup()
    n_windows = len(module.train_set)
    assert len(module.train_dataloader()) == n_windows // 5 and n_windows % 5 != 0
    seen = Counter(tuple(row.tolist()) for inputs, _ in module.train_dataloader() for row in inputs)
    windows = Counter(tuple(module.train_set[i][0].tolist()) for i in range(n_windows))
    assert seen.total() == n_windows // 5 * 5 and seen <= windows  # drawn without replacement
    assert torch.equal(first_batch(0), first_batch(0)) and not torch.equal(first_batch(0), first_batch(1))


def test_bpe_bytes_per_token(small_corpus, bpe_files):
    module = make_files_module(
        small_corpus, tokenizer={"kind": "file", "path": str(bpe_files["json"])}, vocab_size=BPE_VOCAB
    )
    module.setup()
    text = "\n\n".join(load_corpus("files", paths=str(small_corpus)))
    assert module.tokenizer.decode(module.tokens) == text
    for split, part in module.split_tokens.items():
        # lossless: within what sharing out the bytes of the documents a split's boundary cuts moves
        expected = len(module.tokenizer.decode(part).encode()) / len(part)
        assert module.bytes_per_token[split] == pytest.approx(expected, rel=0.05)
    assert min(module.bytes_per_token.values()) > 1.2  # merges make a token longer than a byte
    # the splits' bytes add up to the corpus's
    total = sum(module.bytes_per_token[s] * len(p) for s, p in module.split_tokens.items())
    assert total == pytest.approx(len(text.encode()))


def test_split_bytes_shares_out_the_documents_a_boundary_cuts():
    """Documents of 10, 20 and 30 bytes in 5, 10 and 10 tokens; tokens [3, 12) hold 2 of the first document's 5
    (4 bytes) and 7 of the second's 10 (14 bytes)."""
    document_bytes, lengths = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64), torch.tensor([5, 10, 10])
    assert split_bytes(document_bytes, lengths, 3, 12) == 18.0
    assert split_bytes(document_bytes, lengths, 5, 25) == 50.0 and split_bytes(document_bytes, lengths, 0, 25) == 60.0


def test_bytes_per_token_counts_the_texts_bytes_for_a_tokenizer_without_a_decoder(tmp_path):
    """A WordLevel tokenizer has no decoder: ``decode`` puts a space between any two tokens ("word1 ," for "word1,"),
    so bytes counted from the decoded text would be too many (bits per byte too good). The text's own bytes are
    counted."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    small_corpus = tmp_path / "corpus"
    for index in range(3):
        write(small_corpus / f"part{index}.txt", " ".join(f"word{(i * 7 + index) % 23}," for i in range(200)))
    text = "\n\n".join(load_corpus("files", paths=str(small_corpus)))
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", text)))
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "wordlevel.json"))
    module = make_files_module(small_corpus, tokenizer={"kind": "file", "path": str(tmp_path / "wordlevel.json")})
    module.setup()
    assert len(module.tokenizer.decode(module.tokens).encode()) > 1.1 * len(text.encode())  # decoding adds bytes
    total = sum(module.bytes_per_token[s] * len(p) for s, p in module.split_tokens.items())
    assert total == pytest.approx(len(text.encode()))
    n_test = len(module.split_tokens["test"])  # the test split lies inside the last document
    last = load_corpus("files", paths=str(small_corpus))[-1]
    expected = len(last.encode()) / len(module.tokenizer.encode(last))
    assert module.bytes_per_token["test"] == pytest.approx(expected) and n_test > 0


def test_no_validation_split_gives_empty_loader(small_corpus):
    module = make_files_module(small_corpus, val_fraction=0, test_fraction=0.2)
    module.setup()
    assert module.val_dataloader() == [] and len(module.split_tokens["val"]) == 0
    assert set(module.bytes_per_token) == {"train", "test"}
    assert len(module.split_tokens["train"]) + len(module.split_tokens["test"]) == len(module.tokens)


@pytest.mark.e2e
def test_lightning_skips_validation_without_val_split(small_corpus):
    import lightning as L

    class Bigram(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.logits = torch.nn.Embedding(256, 256)
            self.steps = {"train": 0, "val": 0}

        def training_step(self, batch, batch_idx):
            self.steps["train"] += 1
            inputs, targets = batch
            return torch.nn.functional.cross_entropy(self.logits(inputs).flatten(0, 1), targets.flatten())

        def validation_step(self, batch, batch_idx):
            self.steps["val"] += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Bigram()
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=make_files_module(small_corpus, val_fraction=0))
    assert model.steps["train"] > 0 and model.steps["val"] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, r"seq_len=0 must be a positive integer"),
        ({"val_fraction": 1.0}, r"val_fraction=1.0 must be a fraction in \[0, 1\)"),
        ({"test_fraction": -0.1}, r"test_fraction=-0.1 must be a fraction in \[0, 1\)"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, r"val_fraction=0.5 \+ test_fraction=0.5 = 1 leaves no training"),
        ({"vocab_size": 300}, r"data.vocab_size=300 but tokenizer 'byte' has 256 tokens; set data.vocab_size=256"),
        ({"tokenizer": {"kind": "byte", "lowercase": True}}, r"tokenizer keys \['lowercase'\] are not supported"),
        ({"source": "files"}, r"source='files' needs paths="),
        ({"source": "hf"}, r"source='hf' needs hf_dataset="),
        ({"drop_last": "no"}, r"drop_last='no' must be true or false"),  # was taken as true
        ({"pin_memory": "no"}, r"pin_memory='no' must be true or false"),
    ],
)
def test_module_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TextDataModule(**kwargs)


def test_split_too_small_for_seq_len(small_corpus):
    module = make_files_module(small_corpus, seq_len=512, val_fraction=0.05, test_fraction=0.05)
    n = len(encode_corpus(ByteTokenizer(), load_corpus("files", paths=str(small_corpus)))[0])
    with pytest.raises(
        ValueError, match=rf"the val split has {int(0.05 * n)} tokens .* seq_len \+ 1 = 513; use a smaller"
    ):
        module.setup()


def test_hydra_configs_instantiate(small_corpus):
    base = OmegaConf.load(CONFIG_DIR / "pydoc_text.yaml")
    module = instantiate(base, seed=0)
    assert isinstance(module, TextDataModule) and module.vocab_size == 256 and module.seq_len == 256
    for name, key in (("text_files", "paths"), ("hf_text", "hf_dataset")):
        config = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
        assert OmegaConf.is_missing(config, key)
        assert set(config) == set(base)  # the same keys as the default: switching corpus changes no others
    files = OmegaConf.load(CONFIG_DIR / "text_files.yaml")
    files.paths = [str(small_corpus)]
    module = instantiate(files, seed=0, seq_len=8, batch_size=4)
    module.setup()
    assert len(module.tokens) == len("\n\n".join(load_corpus("files", paths=str(small_corpus))).encode())


def test_a_rebuilt_train_loader_continues_with_the_next_epochs_order(small_corpus):
    """Lightning builds the loader again each epoch with trainer.reload_dataloaders_every_n_epochs=1: every epoch
    replayed epoch 0's order."""

    def epoch_inputs(loader) -> torch.Tensor:
        return torch.cat([batch[0] for batch in loader])

    module = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1)
    loader = module.train_dataloader()
    expected = [epoch_inputs(loader) for _ in range(3)]  # one loader, three epochs
    assert not torch.equal(expected[0], expected[1])
    rebuilt = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1)
    assert all(torch.equal(epoch_inputs(rebuilt.train_dataloader()), epoch) for epoch in expected)


@pytest.mark.parametrize("change", [{"batch_size": 8}, {"seq_len": 7}], ids=["batch_size", "windows"])
def test_a_mid_epoch_resume_with_other_batches_or_windows_is_refused(small_corpus, change):
    """The saved position counts batches of the saved loader: with another batch size it would skip other windows
    (windows never seen that epoch, or seen twice), with another number of windows another order. Starting the next
    epoch instead left Lightning finishing the cut epoch with the next epoch's first batches, one epoch ahead for the
    rest of the run. The resume is refused, naming what changed; at an epoch's end it goes on."""
    module = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1)
    iterator = iter(module.train_dataloader())
    [next(iterator) for _ in range(3)]
    state = {"train_sampler": module._train_sampler.state_dict(consumed_batches=2, epoch_done=False)}
    resumed = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1, **change)
    resumed.load_state_dict(state)
    saved = module._train_sampler
    key, before = ("batch_size", saved.batch_size) if "batch_size" in change else ("dataset_size", saved.dataset_size)
    with pytest.raises(ValueError, match=rf"after batch 2 of epoch 0 .*{key} {before} \(now \d+\)"):
        resumed.train_dataloader()
    done = {"train_sampler": module._train_sampler.state_dict(consumed_batches=2, epoch_done=True)}
    at_the_end = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1, **change)
    at_the_end.load_state_dict(done)
    windows = [tuple(row.tolist()) for batch in at_the_end.train_dataloader() for row in batch[0]]
    fresh = make_files_module(small_corpus, val_fraction=0.1, test_fraction=0.1, **change)
    loader = fresh.train_dataloader()
    next_epoch = [[tuple(row.tolist()) for batch in loader for row in batch[0]] for _ in range(2)][1]
    assert windows == next_epoch
