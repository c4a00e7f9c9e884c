"""Fashion-MNIST (Xiao et al., 2017): locate, download, parse into in-memory uint8 tensors.

The four standard IDX files (``train-images-idx3-ubyte.gz`` ...; the un-gzipped names work too) are
looked for, in this order, in:

1. an explicit ``root`` (if given it must hold the files: no fallback),
2. ``<data_dir>/fashion-mnist``,
3. ``/usr/share/datasets/fashion-mnist`` (Debian package ``dataset-fashion-mnist``, ``make data``),
4. with ``download=True``: fetched from the official mirror into ``<data_dir>/fashion-mnist``.

The whole set is small (70k images, 55 MB as uint8) and is held in memory.
"""

from __future__ import annotations

import os
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import torch

from moekit.utils.atomic import atomic_write

from .idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx, write_idx
from .in_memory import ImageArrays

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_MIRROR",
    "FASHION_MNIST_STD",
    "SYSTEM_FASHION_MNIST_DIR",
    "download_fashion_mnist",
    "fashion_mnist_files",
    "load_fashion_mnist",
    "locate_fashion_mnist",
    "read_fashion_mnist",
    "write_fake_fashion_mnist",
]

FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
# Role -> file name without ".gz".
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)
FASHION_MNIST_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
SYSTEM_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IMAGE_SIZE = 28


def fashion_mnist_files(directory: str | os.PathLike[str]) -> dict[str, Path | None]:
    """Role -> the file found in ``directory`` (``<name>.gz`` preferred over ``<name>``), None when absent."""
    directory = Path(directory)
    found: dict[str, Path | None] = {}
    for role, name in FASHION_MNIST_FILES.items():
        candidates = [directory / f"{name}.gz", directory / name]
        found[role] = next((path for path in candidates if path.is_file()), None)
    return found


def _describe_missing(directory: Path) -> str:
    if not directory.is_dir():
        return "directory does not exist"
    missing = [FASHION_MNIST_FILES[role] for role, path in fashion_mnist_files(directory).items() if path is None]
    return "missing " + ", ".join(f"{name}[.gz]" for name in missing)


def _how_to_get(data_dir: Path, searched: list[Path], mirror: str) -> str:
    looked = "\n".join(f"  - {directory} ({_describe_missing(directory)})" for directory in searched)
    names = ", ".join(f"{name}.gz" for name in FASHION_MNIST_FILES.values())
    target = data_dir / "fashion-mnist"
    return (
        f"Fashion-MNIST not found. Searched:\n{looked}\n"
        "Get it with one of:\n"
        f"  - make data   (installs the Debian package dataset-fashion-mnist into {SYSTEM_FASHION_MNIST_DIR})\n"
        "  - sudo apt-get install dataset-fashion-mnist\n"
        f"  - download=True (Hydra: data.download=true) to fetch it from {mirror} into {target}\n"
        f"  - copy the 4 files {names} into {target}"
    )


def _is_complete(directory: Path) -> bool:
    return directory.is_dir() and all(path is not None for path in fashion_mnist_files(directory).values())


def _read_role(path: Path, role: str) -> np.ndarray:
    """The IDX array of one file, checked to be ``[N, 28, 28]`` images or ``[N]`` labels in ``0..9``."""
    if role.endswith("images"):
        images = read_idx(path, IDX_IMAGES_MAGIC)
        if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"Fashion-MNIST file {path}: images are {images.shape[1:]}, expected (28, 28)")
        return images
    labels = read_idx(path, IDX_LABELS_MAGIC)
    if labels.max() >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"Fashion-MNIST file {path}: label {labels.max()} outside 0..{len(FASHION_MNIST_CLASSES) - 1}")
    return labels


def download_fashion_mnist(directory: str | os.PathLike[str], mirror: str = FASHION_MNIST_MIRROR) -> Path:
    """Fetch the files missing from ``directory`` from ``mirror`` (a URL prefix; ``file://`` works too).

    Each file goes to a temporary file in ``directory``, is checked with the IDX parser, then renamed
    into place: an interrupted download never leaves a partial file under the real name.
    Returns ``directory``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for role, found in fashion_mnist_files(directory).items():
        if found is not None:
            continue
        file_name = f"{FASHION_MNIST_FILES[role]}.gz"
        with atomic_write(directory / file_name, "wb", suffix=".part.gz") as temp_file:
            with urllib.request.urlopen(f"{mirror.rstrip('/')}/{file_name}", timeout=60) as response:
                shutil.copyfileobj(response, temp_file)
            temp_file.flush()
            _read_role(Path(temp_file.name), role)  # a bad download raises here and is never renamed
    return directory


def read_fashion_mnist(directory: str | os.PathLike[str]) -> ImageArrays:
    """Parse the four files in ``directory``: images ``[N, 1, 28, 28]`` uint8, labels ``[N]`` int64.

    Checks each file (see :func:`~moekit.data.idx.read_idx`), that images are 28x28, labels in
    ``0..9``, and that each split has as many labels as images; errors name the file.
    """
    directory = Path(directory)
    paths = fashion_mnist_files(directory)
    if not _is_complete(directory):
        raise FileNotFoundError(f"Fashion-MNIST directory {directory}: {_describe_missing(directory)}")
    arrays = {role: _read_role(path, role) for role, path in paths.items() if path is not None}
    for split in ("train", "test"):
        n_images, n_labels = len(arrays[f"{split}_images"]), len(arrays[f"{split}_labels"])
        if n_images != n_labels:
            raise ValueError(
                f"Fashion-MNIST {split} split in {directory}: {n_images} images in {paths[f'{split}_images']} "
                f"but {n_labels} labels in {paths[f'{split}_labels']}"
            )
    return ImageArrays(
        train_images=torch.from_numpy(arrays["train_images"].copy()).unsqueeze(1),
        train_labels=torch.from_numpy(arrays["train_labels"].astype(np.int64)),
        test_images=torch.from_numpy(arrays["test_images"].copy()).unsqueeze(1),
        test_labels=torch.from_numpy(arrays["test_labels"].astype(np.int64)),
        source=directory,
        class_names=FASHION_MNIST_CLASSES,
    )


def locate_fashion_mnist(
    root: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] = "data",
    download: bool = False,
    system_dir: str | os.PathLike[str] = SYSTEM_FASHION_MNIST_DIR,
    mirror: str = FASHION_MNIST_MIRROR,
) -> Path:
    """The directory holding the four files, searched in the order of the module docstring.

    Raises:
        FileNotFoundError: ``root`` is given but incomplete, or nothing was found (and the download,
            if asked for, failed); the message lists the directories searched and how to get the data.
    """
    if root is not None:
        root = Path(root)
        if not _is_complete(root):
            raise FileNotFoundError(
                f"Fashion-MNIST root={root}: {_describe_missing(root)}. Put the 4 IDX files there, or leave "
                f"root unset to search {Path(data_dir) / 'fashion-mnist'} and {system_dir} (see `make data`)."
            )
        return root
    searched = [Path(data_dir) / "fashion-mnist", Path(system_dir)]
    for directory in searched:
        if _is_complete(directory):
            return directory
    if download:
        try:
            return download_fashion_mnist(searched[0], mirror)
        except (OSError, ValueError) as err:  # urllib.error.URLError and timeouts are OSErrors
            how_to_get = _how_to_get(Path(data_dir), searched, mirror)
            raise FileNotFoundError(f"Downloading Fashion-MNIST from {mirror} failed: {err}\n{how_to_get}") from err
    raise FileNotFoundError(_how_to_get(Path(data_dir), searched, mirror))


def load_fashion_mnist(
    root: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] = "data",
    download: bool = False,
    system_dir: str | os.PathLike[str] = SYSTEM_FASHION_MNIST_DIR,
) -> ImageArrays:
    """:func:`locate_fashion_mnist` then :func:`read_fashion_mnist`."""
    return read_fashion_mnist(locate_fashion_mnist(root, data_dir, download, system_dir))


def write_fake_fashion_mnist(
    directory: str | os.PathLike[str], n_train: int, n_test: int, seed: int = 0, compress: bool = True
) -> Path:
    """Helper for tests and smoke runs: write a tiny stand-in for Fashion-MNIST into ``directory``.

    Writes the four IDX files (``.gz`` if ``compress``) with ``n_train`` / ``n_test`` images
    ``[28, 28]`` and class-balanced labels (``i % 10`` shuffled). Pixels are 0 or one bright value,
    with the fraction of bright pixels chosen so that the pixel mean and std match Fashion-MNIST's
    (``FASHION_MNIST_MEAN`` / ``FASHION_MNIST_STD``): normalised batches have mean ~0, std ~1. Each
    class has its own bright-pixel template (pixels follow it with probability 0.9), so a model can
    learn the labels. Returns ``directory``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # A two-valued pixel {0, b} that is b with probability p has mean p*b and variance p(1-p)b^2.
    mean, std = FASHION_MNIST_MEAN[0], FASHION_MNIST_STD[0]
    bright_fraction = mean**2 / (mean**2 + std**2)
    bright_value = round(255 * (mean**2 + std**2) / mean)
    n_pixels = IMAGE_SIZE * IMAGE_SIZE
    n_classes = len(FASHION_MNIST_CLASSES)
    templates = np.zeros((n_classes, n_pixels), dtype=bool)
    for template in templates:
        template[rng.choice(n_pixels, size=round(bright_fraction * n_pixels), replace=False)] = True
    follow_template = 0.9
    # Off-template pixels turn bright with the probability that keeps the overall bright fraction.
    stray_probability = bright_fraction * (1 - follow_template) / (1 - bright_fraction)
    suffix = ".gz" if compress else ""
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.permutation(np.arange(n) % n_classes).astype(np.uint8)
        bright_probability = np.where(templates[labels], follow_template, stray_probability)
        images = np.where(rng.random((n, n_pixels)) < bright_probability, bright_value, 0).astype(np.uint8)
        images = images.reshape(n, IMAGE_SIZE, IMAGE_SIZE)
        write_idx(directory / f"{FASHION_MNIST_FILES[f'{split}_images']}{suffix}", images)
        write_idx(directory / f"{FASHION_MNIST_FILES[f'{split}_labels']}{suffix}", labels)
    return directory
