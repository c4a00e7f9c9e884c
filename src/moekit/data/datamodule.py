"""``ImageClassificationDataModule``: Fashion-MNIST, CIFAR-10/100 or an ImageNet-style folder tree.

Fashion-MNIST and CIFAR are held in memory as uint8 tensors and augmented a batch at a time with
tensor ops (:mod:`moekit.data.in_memory`); ImageFolder goes through torchvision's ``ImageFolder``
with timm's ``create_transform``. Every loader yields ``(images [B, C, S, S] float32 normalised,
labels [B] int64)`` with ``S = img_size``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.transforms.functional import pil_to_tensor

from .cifar import load_cifar
from .fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist, locate_fashion_mnist
from .imagefolder import imagefolder_class_names, imagefolder_split_dirs, open_imagefolder_split
from .in_memory import BatchTransform, ImageArrays, InMemoryImageDataset, keep_batch
from .resumable import ResumableTrainOrderMixin, SeededBatches

__all__ = ["AUGMENTATIONS", "DATASETS", "DatasetSpec", "ImageClassificationDataModule", "eval_images"]

AUGMENTATIONS = ("none", "basic")


@dataclass(frozen=True)
class DatasetSpec:
    """What is known about a dataset before reading it.

    Attributes:
        in_chans: image channels.
        native_size: input height = width when ``img_size`` is None.
        mean, std: per-channel pixel statistics (pixels in ``[0, 1]``) used to normalise.
        num_classes: None when read from the folder tree (imagefolder).
        crop_padding: padding of the "basic" random crop (in-memory datasets).
    """

    in_chans: int
    native_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int | None
    crop_padding: int = 0


DATASETS: dict[str, DatasetSpec] = {
    "fashion_mnist": DatasetSpec(1, 28, FASHION_MNIST_MEAN, FASHION_MNIST_STD, 10, crop_padding=2),
    "cifar10": DatasetSpec(3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 10, crop_padding=4),
    "cifar100": DatasetSpec(3, 32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 100, crop_padding=4),
    "imagefolder": DatasetSpec(3, 224, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, None),
}


def eval_images(dataset: str, images: list[Image.Image], img_size: int | None = None) -> Tensor:
    """PIL images -> ``[N, C, S, S]`` float32, prepared like ``dataset``'s evaluation split at ``img_size`` (None:
    the native size): an in-memory dataset's channels, size and normalisation (``BatchTransform``), or
    imagefolder's timm evaluation transform. Needs no data on disk."""
    spec = DATASETS[dataset]
    size = img_size or spec.native_size
    if dataset == "imagefolder":
        transform = create_transform(size, is_training=False, mean=spec.mean, std=spec.std)
        return torch.stack([transform(image.convert("RGB")) for image in images])
    native = (spec.native_size, spec.native_size)  # the size of the dataset's own images
    mode = "L" if spec.in_chans == 1 else "RGB"
    pixels = torch.stack(
        [pil_to_tensor(image.convert(mode).resize(native, Image.Resampling.BILINEAR)) for image in images]
    )
    return BatchTransform(spec.mean, spec.std, size)(pixels)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ImageClassificationDataModule(ResumableTrainOrderMixin, L.LightningDataModule):
    """Train / validation / test loaders of ``(images [B, C, S, S] float32, labels [B] int64)``.

    Args:
        dataset: one of ``DATASETS``: "fashion_mnist", "cifar10", "cifar100", "imagefolder".
        root: where the data is. fashion_mnist: the folder of the 4 IDX files (default: search
            ``<data_dir>/fashion-mnist`` then ``/usr/share/datasets/fashion-mnist``); cifar: the
            folder holding torchvision's extracted archive (default ``data_dir``); imagefolder
            (required): the folder with ``train/``, ``val/`` and optionally ``test/`` (else test = val).
        data_dir: the project's data folder (Hydra: ``${paths.data_dir}``).
        download: fetch missing Fashion-MNIST / CIFAR files (needs internet).
        batch_size: training batch size.
        eval_batch_size: validation / test batch size (default ``batch_size``).
        num_workers: DataLoader worker processes (persistent when > 0).
        val_size: examples held out of the training set for validation: a count, or a fraction in
            ``[0, 1)`` (at least one example when above 0); a seeded random split. 0: no validation loader.
            imagefolder uses ``val/`` instead.
        seed: seeds the validation split, ``limit_train_samples`` and the training shuffle.
        img_size: input height = width, None for the dataset's native size (28, 32, imagefolder 224).
        augment: "none" or "basic". In-memory datasets: "basic" = random crop of the zero-padded image
            + horizontal flip; imagefolder: "basic" = timm's training transform (random resized crop,
            flip, colour jitter, plus ``auto_augment``).
        auto_augment: imagefolder only: timm auto-augment policy, e.g. "rand-m9-mstd0.5-inc1".
        pin_memory: DataLoader ``pin_memory``.
        limit_train_samples: train on a seeded random subset of this many examples (quick runs).
        num_classes, in_chans: the values the config expects (configs share them with the model via
            ``${data.num_classes}``); a dataset that disagrees is an error. None: no check.
    """

    def __init__(
        self,
        dataset: str = "fashion_mnist",
        root: str | None = None,
        data_dir: str = "data",
        download: bool = False,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        val_size: int | float = 5000,
        seed: int = 0,
        img_size: int | None = None,
        augment: str = "basic",
        auto_augment: str | None = None,
        pin_memory: bool = False,
        limit_train_samples: int | None = None,
        num_classes: int | None = None,
        in_chans: int | None = None,
    ):
        super().__init__()
        if dataset not in DATASETS:
            raise ValueError(f"dataset={dataset!r} is not supported; choose one of {sorted(DATASETS)}")
        if augment not in AUGMENTATIONS:
            raise ValueError(f"augment={augment!r} is not supported; choose one of {list(AUGMENTATIONS)}")
        if auto_augment is not None and dataset != "imagefolder":
            raise ValueError(f"auto_augment={auto_augment!r} applies to dataset='imagefolder' only, not {dataset!r}")
        if img_size is not None and not (_is_int(img_size) and img_size > 0):
            raise ValueError(f"img_size={img_size!r} must be a positive integer, or None for the native size")
        if not ((_is_int(val_size) and val_size >= 0) or (isinstance(val_size, float) and 0 <= val_size < 1)):
            raise ValueError(f"val_size={val_size!r} must be a count >= 0 or a fraction in [0, 1)")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size),
                            ("limit_train_samples", limit_train_samples)):  # fmt: skip
            if value is not None and not (_is_int(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name, value in (("download", download), ("pin_memory", pin_memory)):
            if not isinstance(value, bool):  # data.pin_memory=no is the string 'no', which is true
                raise ValueError(f"{name}={value!r} must be true or false")
        if not (_is_int(num_workers) and num_workers >= 0):
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0")
        if dataset == "imagefolder" and root is None:
            raise ValueError("dataset='imagefolder' needs root=<folder with train/ and val/> (Hydra: data.root=...)")
        creates_root = download and dataset in ("cifar10", "cifar100")
        if root is not None and not Path(root).is_dir() and not creates_root:
            raise ValueError(f"root={root!r} does not exist (or is not a directory); fix the path or leave root unset")
        self.save_hyperparameters()

        self.dataset = dataset
        self.spec = DATASETS[dataset]
        self.root = None if root is None else Path(root)
        self.data_dir = Path(data_dir)
        self.download = download
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.val_size = val_size
        self.seed = seed
        self._img_size = img_size or self.spec.native_size
        self.augment = augment
        self.auto_augment = auto_augment
        self.pin_memory = pin_memory
        self.limit_train_samples = limit_train_samples

        self.split_dirs = imagefolder_split_dirs(root) if dataset == "imagefolder" else None
        self.class_names = imagefolder_class_names(self.split_dirs["train"]) if self.split_dirs else None
        self.label_names: tuple[str, ...] | None = tuple(self.class_names) if self.class_names else None
        # label i's name: the folder names, or the dataset's own names once set up (in-memory datasets)
        for name, expected, actual in (
            ("num_classes", num_classes, self.num_classes),
            ("in_chans", in_chans, self.in_chans),
        ):
            if expected is not None and expected != actual:
                raise ValueError(
                    f"data.{name}={expected} but dataset {dataset!r} has {actual}; set data.{name}={actual} "
                    "(the model reads it through ${data." + name + "})"
                )
        # Set by setup(): indices into the original training set; datasets.
        self.train_indices: Tensor | None = None
        self.val_indices: Tensor | None = None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self._train_labels: Tensor | None = None  # [N] labels of the whole original training set
        self._train_eval_set: Dataset | None = None  # whole original training set, eval transform

    @property
    def num_classes(self) -> int:
        return self.spec.num_classes if self.class_names is None else len(self.class_names)

    @property
    def in_chans(self) -> int:
        return self.spec.in_chans

    @property
    def img_size(self) -> int:
        """Input height = width of every batch."""
        return self._img_size

    @property
    def mean(self) -> tuple[float, ...]:
        return tuple(self.spec.mean)

    @property
    def std(self) -> tuple[float, ...]:
        return tuple(self.spec.std)

    @property
    def _in_memory(self) -> bool:
        return self.dataset != "imagefolder"

    def prepare_data(self) -> None:
        """Download (once, on one process) when ``download`` is set."""
        if not self.download:
            return
        if self.dataset == "fashion_mnist":
            locate_fashion_mnist(self.root, self.data_dir, download=True)
        elif self.dataset in ("cifar10", "cifar100"):
            load_cifar(self.dataset, self.root or self.data_dir, download=True)

    def setup(self, stage: str | None = None) -> None:
        """Read the data and build all three splits (whatever ``stage``); later calls do nothing."""
        if self.train_set is not None:
            return
        if self._in_memory:
            self._setup_in_memory(self._read_in_memory())
        else:
            self._setup_imagefolder()

    def _read_in_memory(self) -> ImageArrays:
        if self.dataset == "fashion_mnist":
            return load_fashion_mnist(self.root, self.data_dir, self.download)
        return load_cifar(self.dataset, self.root or self.data_dir, self.download)

    def _split_indices(self, n_train: int, held_out: int | float) -> None:
        """Seeded split of ``range(n_train)`` into ``val_indices [n_val]`` and ``train_indices [n_train - n_val]``."""
        # a fraction above 0 holds out at least one example (rounded to none it would turn validation off)
        n_val = max(round(held_out * n_train), int(held_out > 0)) if isinstance(held_out, float) else held_out
        if n_val >= n_train:
            raise ValueError(
                f"val_size={held_out!r} leaves no training data: the {self.dataset} training set has {n_train} "
                f"examples; use a smaller count or a fraction in [0, 1)"
            )
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(self.seed))
        self.val_indices, self.train_indices = order[:n_val], order[n_val:]

    def _limited_train_indices(self) -> list[int]:
        return self.train_indices[: self.limit_train_samples].tolist()

    def _batch_transform(self, train: bool) -> BatchTransform:
        augment = train and self.augment == "basic"
        return BatchTransform(
            self.mean, self.std, self.img_size, crop_padding=self.spec.crop_padding if augment else 0, hflip=augment
        )

    def _setup_in_memory(self, arrays: ImageArrays) -> None:
        self._split_indices(len(arrays.train_labels), self.val_size)
        eval_transform = self._batch_transform(train=False)
        train_index = torch.tensor(self._limited_train_indices(), dtype=torch.long)
        self.train_set = InMemoryImageDataset(
            arrays.train_images[train_index], arrays.train_labels[train_index], self._batch_transform(train=True)
        )
        self.val_set = InMemoryImageDataset(
            arrays.train_images[self.val_indices], arrays.train_labels[self.val_indices], eval_transform
        )
        self.test_set = InMemoryImageDataset(arrays.test_images, arrays.test_labels, eval_transform)
        self._train_labels = arrays.train_labels
        self.label_names = arrays.class_names
        self._train_eval_set = InMemoryImageDataset(arrays.train_images, arrays.train_labels, eval_transform)

    def _setup_imagefolder(self) -> None:
        eval_transform = create_transform(self.img_size, is_training=False, mean=self.mean, std=self.std)
        if self.augment == "basic":
            train_transform = create_transform(
                self.img_size, is_training=True, auto_augment=self.auto_augment, mean=self.mean, std=self.std
            )
        else:
            train_transform = eval_transform
        train_folder = open_imagefolder_split(self.split_dirs["train"], train_transform)
        self._split_indices(len(train_folder), 0)  # validation comes from val/
        self.train_set = Subset(train_folder, self._limited_train_indices())
        self.val_set = open_imagefolder_split(self.split_dirs["val"], eval_transform)
        self.test_set = open_imagefolder_split(self.split_dirs["test"], eval_transform)
        self._train_labels = torch.tensor(train_folder.targets, dtype=torch.int64)
        self._train_eval_set = copy.copy(train_folder)
        self._train_eval_set.transform = eval_transform

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
        # The order of the training batches is a function of (seed, epoch) that a checkpoint can resume
        # mid-epoch (moekit.data.resumable); every loader has its own generator so iterating it never
        # draws from the global one (which the augmentation and the model use). Worker processes draw each
        # training batch's augmentation from generators seeded by the batch (SeededBatches): exact on resume too.
        seeded = shuffle and self.num_workers > 0
        sampler = self._train_sampler_for(len(dataset), batch_size, self.seed, seeded) if shuffle else None
        if seeded:
            dataset = SeededBatches(dataset)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            generator=torch.Generator().manual_seed(self.seed),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
            collate_fn=keep_batch if self._in_memory else None,
        )

    def _require_setup(self) -> None:
        if self.train_set is None:
            self.setup()

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded generator: a new order each epoch, the same sequence for the same seed), augmented."""
        self._require_setup()
        return self._loader(self.train_set, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        """The held-out split in order; an empty list (no validation) when ``val_size`` is 0."""
        self._require_setup()
        if len(self.val_set) == 0:
            return []
        return self._loader(self.val_set, self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        self._require_setup()
        return self._loader(self.test_set, self.eval_batch_size, shuffle=False)

    def _stack(self, dataset: Dataset) -> tuple[Tensor, Tensor]:
        """All of ``dataset`` as ``(images [N, C, S, S] float32, labels [N] int64)``."""
        batches = list(self._loader(dataset, self.eval_batch_size, shuffle=False))
        return torch.cat([images for images, _ in batches]), torch.cat([labels for _, labels in batches])

    def fewshot_arrays(self, shots: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """``shots`` examples per class drawn (seeded) from the training split, without augmentation.

        Returns ``(images [num_classes * shots, C, S, S] float32 normalised, labels [num_classes * shots]
        int64)``, grouped by class (class 0 first). Never draws from the validation split.
        """
        if not (_is_int(shots) and shots > 0):
            raise ValueError(f"shots={shots!r} must be a positive integer")
        self._require_setup()
        generator = torch.Generator().manual_seed(seed)
        train_labels = self._train_labels[self.train_indices]
        chosen = []
        for label in range(self.num_classes):
            members = self.train_indices[train_labels == label]
            if len(members) < shots:
                raise ValueError(
                    f"fewshot_arrays: class {label} has {len(members)} training examples, fewer than shots={shots}"
                )
            chosen.append(members[torch.randperm(len(members), generator=generator)[:shots]])
        return self._stack(Subset(self._train_eval_set, torch.cat(chosen).tolist()))
