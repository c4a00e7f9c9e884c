"""An ImageNet-style folder tree: ``<root>/{train,val}[,test]/<class name>/<image>``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from PIL import Image
from torchvision.datasets import ImageFolder

__all__ = [
    "UnreadableImageError",
    "imagefolder_class_names",
    "imagefolder_split_dirs",
    "open_imagefolder_split",
    "read_rgb_image",
]


class UnreadableImageError(ValueError):
    """An image file of the folder tree that PIL cannot decode (the message names the file)."""


def read_rgb_image(path: str) -> Image.Image:
    """torchvision's PIL loader (``ImageFolder(loader=...)``) with an error that names the file.

    A 16-bit greyscale image (PNG, TIFF, PGM: modes ``I;16*`` and ``I``) is scaled to 8 bits as PIL scales
    16-bit colour (a value of 65535 becomes 255); PIL's own conversion clips it at 255, which turns most of
    such an image white. A file that is not an image, is truncated or is too large to decode raises
    :class:`UnreadableImageError` (a ``ValueError``) naming the file and the fix, instead of PIL's
    error deep inside a ``DataLoader`` worker.
    """
    try:
        with open(path, "rb") as file:
            image = Image.open(file)
            if image.mode.startswith("I"):  # 16-bit greyscale: 0..65535 to 0..255
                image = image.convert("I").point(lambda value: value / 256)
            return image.convert("RGB")  # decodes now: a truncated file fails here, not later
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise UnreadableImageError(
            f"cannot read the image {path} ({type(err).__name__}: {err}); delete, replace or move the file "
            "(every file read as an image, under an image folder's class folders or given to predict, must be one "
            "PIL can open)"
        ) from None


def imagefolder_split_dirs(root: str | os.PathLike[str]) -> dict[str, Path]:
    """``{"train", "val", "test"}`` -> split folder; ``test`` is ``val`` when ``<root>/test`` is absent.

    Raises:
        FileNotFoundError: ``<root>/train`` or ``<root>/val`` is missing (the message names it).
        ValueError: train/ holds one class folder (nothing to classify), or a split's class folders differ from
            train's (labels would not line up).
    """
    root = Path(root)
    dirs = {split: root / split for split in ("train", "val", "test")}
    for split in ("train", "val"):
        if not dirs[split].is_dir():
            raise FileNotFoundError(
                f"imagefolder: {dirs[split]} is not a directory; root={root} must hold train/ and val/ "
                "(and optionally test/), each with one sub-folder per class"
            )
    if not dirs["test"].is_dir():
        dirs["test"] = dirs["val"]
    train_classes = imagefolder_class_names(dirs["train"])
    if len(train_classes) == 1:
        raise ValueError(
            f"imagefolder: {dirs['train']} holds one class folder ({train_classes[0]!r}); a classifier needs two or "
            f"more: put each class's images in its own folder ({dirs['train']}/<class>/<image>)"
        )
    for split in ("val", "test"):
        classes = imagefolder_class_names(dirs[split])
        if classes != train_classes:
            difference = sorted(set(classes) ^ set(train_classes))
            raise ValueError(
                f"imagefolder: class folders of {dirs[split]} differ from {dirs['train']}: {difference[:10]}"
            )
    return dirs


def open_imagefolder_split(split_dir: Path, transform: Callable | None) -> ImageFolder:
    """torchvision's ``ImageFolder`` of one split, read with :func:`read_rgb_image`; a class folder without an
    image is refused naming the split's folder (torchvision names only the class)."""
    try:
        return ImageFolder(str(split_dir), transform=transform, loader=read_rgb_image)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"imagefolder: {split_dir}: {err} Put each class's images in its folder ({split_dir}/<class>/<image>)"
        ) from None


def imagefolder_class_names(split_dir: Path) -> list[str]:
    """The sorted class-folder names of one split (what torchvision's ImageFolder maps to 0..K-1)."""
    classes = sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"imagefolder: {split_dir} has no class sub-folders")
    return classes
