"""CIFAR-10 / CIFAR-100 through torchvision, converted to in-memory uint8 tensors."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torchvision.datasets import CIFAR10, CIFAR100

from .in_memory import ImageArrays

__all__ = ["CIFAR_CLASSES", "load_cifar"]

CIFAR_CLASSES = {"cifar10": CIFAR10, "cifar100": CIFAR100}


def load_cifar(name: str, root: str | os.PathLike[str], download: bool = False) -> ImageArrays:
    """Both splits of CIFAR-10/100 from ``<root>/cifar-10-batches-py`` (``cifar-100-python``):
    images ``[N, 3, 32, 32]`` uint8, labels ``[N]`` int64.

    Args:
        name: "cifar10" or "cifar100".
        root: the folder that holds (or, with ``download``, receives) torchvision's extracted archive.
        download: fetch the archive when missing (needs internet).

    Raises:
        FileNotFoundError: the data is absent (or corrupt) and ``download`` is off or failed; the
            message names the folder looked in and how to get the archive.
    """
    dataset_class = CIFAR_CLASSES[name]
    root = Path(root)
    splits = {}
    try:
        for split in ("train", "test"):
            splits[split] = dataset_class(str(root), train=split == "train", download=download)
    except (RuntimeError, OSError) as err:  # torchvision: RuntimeError when absent, URLError when offline
        extracted = root / dataset_class.base_folder
        raise FileNotFoundError(
            f"{name} not found or corrupt: looked in {extracted} ({err}). Get it with download=True "
            f"(Hydra: data.download=true; needs internet) which fetches {dataset_class.url} into {root}, "
            f"or download {dataset_class.filename} yourself and extract it in {root} so that {extracted} exists."
        ) from err

    def images(split: str) -> torch.Tensor:
        return torch.from_numpy(splits[split].data).permute(0, 3, 1, 2).contiguous()  # [N, H, W, C] -> [N, C, H, W]

    def labels(split: str) -> torch.Tensor:
        return torch.tensor(splits[split].targets, dtype=torch.int64)

    classes = tuple(splits["train"].classes)
    return ImageArrays(
        images("train"), labels("train"), images("test"), labels("test"), source=root, class_names=classes
    )
