"""Data: image classification (Fashion-MNIST, the default; CIFAR-10/100; ImageNet-style folders) and text.

``ImageClassificationDataModule`` is the Lightning entry point for images (Hydra configs: ``configs/data/``);
its loaders yield ``(images [B, C, S, S] float32 normalised, labels [B] int64)``. ``TextDataModule``
is the one for language modelling (``configs/data/pydoc_text.yaml`` ...); its loaders yield
``(inputs [B, seq_len] int64, targets [B, seq_len] int64)``, targets = inputs shifted by one token (with
``pack=False`` also ``padding_mask [B, seq_len]`` bool).
"""

from .corpora import load_corpus
from .datamodule import AUGMENTATIONS, DATASETS, DatasetSpec, ImageClassificationDataModule
from .fashion_mnist import (
    FASHION_MNIST_CLASSES,
    SYSTEM_FASHION_MNIST_DIR,
    load_fashion_mnist,
    locate_fashion_mnist,
    read_fashion_mnist,
    write_fake_fashion_mnist,
)
from .in_memory import ImageArrays
from .text import PAD_TARGET, DocumentWindows, TextDataModule, TokenWindows
from .tokenizers import (
    ByteTokenizer,
    FileTokenizer,
    GPT2Tokenizer,
    TextTokenizer,
    build_tokenizer,
    encode_corpus,
)

__all__ = [
    "AUGMENTATIONS",
    "DATASETS",
    "FASHION_MNIST_CLASSES",
    "SYSTEM_FASHION_MNIST_DIR",
    "ByteTokenizer",
    "DatasetSpec",
    "FileTokenizer",
    "GPT2Tokenizer",
    "ImageArrays",
    "ImageClassificationDataModule",
    "TextDataModule",
    "TextTokenizer",
    "TokenWindows",
    "DocumentWindows",
    "PAD_TARGET",
    "build_tokenizer",
    "encode_corpus",
    "load_corpus",
    "load_fashion_mnist",
    "locate_fashion_mnist",
    "read_fashion_mnist",
    "write_fake_fashion_mnist",
]
