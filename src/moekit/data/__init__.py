"""Image-classification data: Fashion-MNIST (the default), CIFAR-10/100 and ImageNet-style folders.

``ImageClassificationDataModule`` is the Lightning entry point (Hydra configs: ``configs/data/``);
the loaders yield ``(images [B, C, S, S] float32 normalised, labels [B] int64)``.
"""

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

__all__ = [
    "AUGMENTATIONS",
    "DATASETS",
    "FASHION_MNIST_CLASSES",
    "SYSTEM_FASHION_MNIST_DIR",
    "DatasetSpec",
    "ImageArrays",
    "ImageClassificationDataModule",
    "load_fashion_mnist",
    "locate_fashion_mnist",
    "read_fashion_mnist",
    "write_fake_fashion_mnist",
]
