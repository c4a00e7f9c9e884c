"""Corpora for language modelling (:func:`load_corpus`, a list of documents):

- "pydoc": Python's own documentation shipped with CPython (``pydoc_data.topics``, ~465k characters),
  offline and deterministic (the default);
- "files": text files, or folders read recursively (``*.txt``, ``*.md``, ``*.rst``);
- "hf": a Hugging Face dataset saved with ``save_to_disk`` (needs ``pip install datasets``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CORPUS_SOURCES", "TEXT_FILE_SUFFIXES", "check_source_args", "load_corpus"]

CORPUS_SOURCES = ("pydoc", "files", "hf")
TEXT_FILE_SUFFIXES = (".txt", ".md", ".rst")

PathLike = str | os.PathLike[str]


def check_source_args(source: str, paths: object, hf_dataset: object) -> None:
    """Errors for an unknown ``source`` and for arguments missing for it or meant for another source."""
    if source not in CORPUS_SOURCES:
        raise ValueError(f"source={source!r} is not supported; choose one of {list(CORPUS_SOURCES)}")
    if source == "files" and paths is None:
        raise ValueError("source='files' needs paths=<file, folder or list of them> (Hydra: data.paths=...)")
    if source == "hf" and hf_dataset is None:
        raise ValueError("source='hf' needs hf_dataset=<folder written by save_to_disk> (Hydra: data.hf_dataset=...)")
    if source != "files" and paths is not None:
        raise ValueError(f"paths={paths!r} is only read with source='files' (source={source!r}); drop it or set source")
    if source != "hf" and hf_dataset is not None:
        raise ValueError(f"hf_dataset={hf_dataset!r} is only read with source='hf' (source={source!r}); drop it")


def _pydoc_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # stripped-down Python builds can leave the standard library's docs out
        raise FileNotFoundError(
            "source='pydoc' needs the standard library module pydoc_data.topics, which this Python lacks; "
            "install the full standard library (e.g. Debian's libpython3-stdlib) or use source='files'"
        ) from err
    return [topics[key] for key in sorted(topics)]


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading byte order mark is no text: dropped
    except UnicodeDecodeError as err:
        raise ValueError(f"text file {str(path)!r} is not valid UTF-8 ({err}); convert it to UTF-8 or drop it") from err


def _text_files(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    """The files of ``paths`` in order: a file as given, a folder's text files recursively, sorted, but for hidden ones
    and those in hidden folders (``.git``, a notebook's ``.ipynb_checkpoints`` copies); a file reached
    twice (named and in a listed folder, or in two nested folders) only where it first comes, so that no document
    is in two splits."""
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not entries:
        raise ValueError("paths=[] lists no file or folder; give at least one (Hydra: data.paths=...)")
    files: list[Path] = []
    for entry in entries:
        if not os.fspath(entry).strip():  # Path("") is the working directory: every text file below it
            raise ValueError(f"paths={paths!r} holds an empty path; give a file or folder (Hydra: data.paths=...)")
        path = Path(os.fspath(entry)).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.suffix.lower() in TEXT_FILE_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and p.is_file()
            )
            if not found:
                raise FileNotFoundError(
                    f"folder {str(entry)!r} holds no text files ({', '.join('*' + s for s in TEXT_FILE_SUFFIXES)}, "
                    "searched recursively, hidden ones left out); add some or give the files' paths explicitly"
                )
            files.extend(found)
        else:
            raise FileNotFoundError(f"paths entry {str(entry)!r} does not exist; fix the path (Hydra: data.paths=...)")
    unique: dict[Path, Path] = {}
    for file in files:
        unique.setdefault(file.resolve(), file)
    return list(unique.values())


def _hf_documents(hf_dataset: PathLike, text_column: str) -> list[str]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("source='hf' needs the datasets package: pip install datasets") from err
    folder = Path(os.fspath(hf_dataset)).expanduser()
    if not folder.is_dir():
        state = "is a file, not a folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(
            f"hf_dataset={str(hf_dataset)!r} {state}; give the folder written by Dataset.save_to_disk (moekit reads "
            "no hub name and downloads nothing: save one with datasets.load_dataset(...).save_to_disk(path))"
        )
    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"hf_dataset={str(hf_dataset)!r} is not a dataset saved with save_to_disk ({err}); "
            "save one with datasets.load_dataset(...).save_to_disk(path)"
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            raise ValueError(
                f"hf_dataset={str(hf_dataset)!r} is a DatasetDict with splits {splits} and no 'train'; save the split "
                "to train on alone: dataset_dict[<split>].save_to_disk(path)"
            )
    if text_column not in loaded.column_names:
        raise ValueError(
            f"text_column={text_column!r} is not a column of hf_dataset={str(hf_dataset)!r}; its columns are "
            f"{loaded.column_names} (Hydra: data.text_column=...)"
        )
    documents = list(loaded[text_column])
    for index, document in enumerate(documents):
        if document is not None and not isinstance(document, str):
            raise ValueError(
                f"text_column={text_column!r} of hf_dataset={str(hf_dataset)!r} holds {type(document).__name__} "
                f"values (row {index}), not strings; choose a text column"
            )
    return [document for document in documents if document is not None]


def load_corpus(
    source: str = "pydoc",
    paths: PathLike | Sequence[PathLike] | None = None,
    hf_dataset: PathLike | None = None,
    text_column: str = "text",
) -> list[str]:
    """The documents of a corpus, in a fixed order; empty documents are dropped.

    Args:
        source: "pydoc": the topics of ``pydoc_data.topics`` (Python's documentation), one document per
            topic in sorted key order. "files": one document per file of ``paths``. "hf": one document
            per row of ``hf_dataset``.
        paths: "files" only: a file, a folder, or a list of them, in that order. A folder contributes
            its ``*.txt``, ``*.md`` and ``*.rst`` files, recursively, sorted by path; a file is read
            whatever its suffix; a file reached twice is read once, where it first comes. Files are read as
            UTF-8 (a leading byte order mark dropped).
        hf_dataset: "hf" only: a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``.
            Of a ``DatasetDict`` only the "train" split is read (or its only split): ``TextDataModule``
            carves validation and test out of it, so the dataset's own held-out splits are never trained on.
        text_column: "hf" only: the column holding the text (None values are skipped).

    Raises:
        ValueError: unknown source, arguments for another source, a missing column, non-UTF-8 files,
            a corpus without any text.
        FileNotFoundError: a missing path, a folder without text files, a folder that is not a saved dataset.
        ImportError: "hf" without the ``datasets`` package.
    """
    check_source_args(source, paths, hf_dataset)
    if source == "pydoc":
        documents, where = _pydoc_documents(), "source='pydoc'"
    elif source == "files":
        documents = [_read_text_file(path) for path in _text_files(paths)]  # type: ignore[arg-type]
        where = f"paths={paths!r}"
    else:
        documents = _hf_documents(hf_dataset, text_column)  # type: ignore[arg-type]
        where = f"hf_dataset={str(hf_dataset)!r} (column {text_column!r})"
    documents = [document for document in documents if document]
    if not documents:
        raise ValueError(f"the corpus of {where} is empty (no text at all); point it at files or rows with text")
    return documents
