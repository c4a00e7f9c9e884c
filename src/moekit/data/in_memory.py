"""Small image datasets held in memory as uint8 tensors, transformed a whole batch at a time.

Per-sample PIL transforms cost far more than a small model's step on a 2-core CPU. Here the
DataLoader fetches a batch with one indexing op (``__getitems__``) and the augmentation is a handful
of vectorised tensor ops on ``[B, C, H, W]`` uint8: a random crop of the zero-padded image and a
horizontal flip, each drawn per sample, then conversion to float, resize and normalisation.

Random draws use torch's global generator: in DataLoader workers it is seeded per worker from the
loader's generator, in the main process by ``lightning.seed_everything``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["BatchTransform", "ImageArrays", "InMemoryImageDataset", "keep_batch", "random_crop", "random_hflip"]


@dataclass(frozen=True)
class ImageArrays:
    """A dataset's train and test splits as tensors.

    Attributes:
        train_images: ``[N, C, H, W]`` uint8.
        train_labels: ``[N]`` int64.
        test_images: ``[M, C, H, W]`` uint8.
        test_labels: ``[M]`` int64.
        source: where it was read from.
        class_names: the name of each label, when the dataset has them.
    """

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    source: Path
    class_names: tuple[str, ...] | None = None  # label i's name


def random_crop(images: Tensor, padding: int) -> Tensor:
    """``[B, C, H, W] -> [B, C, H, W]``: each image zero-padded by ``padding`` and cropped back at a random offset."""
    if padding == 0:
        return images
    batch, _, height, width = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    top = torch.randint(0, 2 * padding + 1, (batch, 1))
    left = torch.randint(0, 2 * padding + 1, (batch, 1))
    rows = (top + torch.arange(height))[:, :, None]  # [B, H, 1]
    cols = (left + torch.arange(width))[:, None, :]  # [B, 1, W]
    batch_index = torch.arange(batch)[:, None, None]
    # Advanced indices around the channel slice put their broadcast dims first: [B, H, W, C].
    return padded[batch_index, :, rows, cols].permute(0, 3, 1, 2)


def random_hflip(images: Tensor, probability: float = 0.5) -> Tensor:
    """``[B, C, H, W] -> [B, C, H, W]``: each image mirrored left-right with ``probability``."""
    flip = torch.rand(images.shape[0]) < probability
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


class BatchTransform:
    """uint8 ``[B, C, H, W]`` -> normalised float32 ``[B, C, size, size]``.

    Args:
        mean, std: per-channel statistics of pixels scaled to ``[0, 1]``.
        size: output height and width; bilinear (antialiased) resize when it differs from the input.
        crop_padding: random-crop padding in pixels, 0 for none.
        hflip: mirror half of the images at random.
    """

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], size: int, crop_padding: int = 0, hflip: bool = False
    ):
        std_tensor = torch.tensor(std, dtype=torch.float32)[:, None, None]
        # (x / 255 - mean) / std == x * scale - shift
        self.scale = 1.0 / (255.0 * std_tensor)
        self.shift = torch.tensor(mean, dtype=torch.float32)[:, None, None] / std_tensor
        self.size = size
        self.crop_padding = crop_padding
        self.hflip = hflip

    def __call__(self, images: Tensor) -> Tensor:
        images = random_crop(images, self.crop_padding)
        if self.hflip:
            images = random_hflip(images)
        pixels = images.float()
        if pixels.shape[-2:] != (self.size, self.size):
            pixels = F.interpolate(pixels, size=(self.size, self.size), mode="bilinear", antialias=True)
        return pixels.mul_(self.scale).sub_(self.shift)


class InMemoryImageDataset(Dataset[tuple[Tensor, Tensor]]):
    """Images ``[N, C, H, W]`` uint8 and labels ``[N]`` int64 with a :class:`BatchTransform`.

    A DataLoader over it must use ``collate_fn=keep_batch``: it then fetches each batch with one call
    to ``__getitems__``, which returns ``(images [B, C, S, S] float32, labels [B] int64)``.
    """

    def __init__(self, images: Tensor, labels: Tensor, transform: BatchTransform):
        if images.dtype != torch.uint8 or images.dim() != 4 or labels.shape != images.shape[:1]:
            raise ValueError(
                f"InMemoryImageDataset: need uint8 images [N, C, H, W] and labels [N], got {images.dtype} "
                f"{tuple(images.shape)} and {tuple(labels.shape)}"
            )
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.transform(self.images[index]), self.labels[index]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        images, labels = self.__getitems__([index])
        return images[0], labels[0]


def keep_batch(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """DataLoader ``collate_fn`` for :class:`InMemoryImageDataset`: the batch is already collated."""
    return batch
