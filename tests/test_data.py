"""The image-classification data layer: IDX parsing, Fashion-MNIST lookup, the Lightning DataModule."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from moekit.data import (
    SYSTEM_FASHION_MNIST_DIR,
    ImageClassificationDataModule,
    cifar,
    load_fashion_mnist,
    locate_fashion_mnist,
    read_fashion_mnist,
    write_fake_fashion_mnist,
)
from moekit.data.cifar import load_cifar
from moekit.data.fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD
from moekit.data.idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx, write_idx
from moekit.data.in_memory import BatchTransform, random_crop, random_hflip

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "data"
N_TRAIN, N_TEST = 600, 100


@pytest.fixture(scope="module")
def fake_dir(tmp_path_factory) -> Path:
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("fashion"), N_TRAIN, N_TEST)


def make_module(fake_dir: Path, **kwargs) -> ImageClassificationDataModule:
    kwargs = {"root": str(fake_dir), "val_size": 100, "batch_size": 32, **kwargs}
    return ImageClassificationDataModule(**kwargs)


# --- IDX parser ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["images-idx3-ubyte", "images-idx3-ubyte.gz"])
def test_idx_round_trip(tmp_path, name):
    images = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    labels = np.arange(5, dtype=np.uint8)
    read_images = read_idx(write_idx(tmp_path / name, images), IDX_IMAGES_MAGIC)
    read_labels = read_idx(write_idx(tmp_path / f"labels-{name}", labels), IDX_LABELS_MAGIC)
    np.testing.assert_array_equal(read_images, images)
    np.testing.assert_array_equal(read_labels, labels)
    if name.endswith(".gz"):
        assert gzip.decompress((tmp_path / name).read_bytes())[:4] == bytes([0, 0, 8, 3])


def test_idx_rejects_wrong_magic(tmp_path):
    path = write_idx(tmp_path / "labels.gz", np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"labels\.gz: magic number 2049, expected 2051"):
        read_idx(path, IDX_IMAGES_MAGIC)


@pytest.mark.parametrize("cut, message", [(-10, "truncated"), (5, "truncated header"), (1000, "trailing bytes")])
def test_idx_rejects_wrong_length(tmp_path, cut, message):
    path = write_idx(tmp_path / "images", np.zeros((3, 4, 4), dtype=np.uint8))
    content = path.read_bytes()
    path.write_bytes(content[:cut] if cut < 1000 else content + b"\0")
    with pytest.raises(ValueError, match=message) as error:
        read_idx(path, IDX_IMAGES_MAGIC)
    assert str(path) in str(error.value)


def test_idx_rejects_truncated_gzip(tmp_path):
    path = write_idx(tmp_path / "images.gz", np.zeros((30, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"images\.gz: not a complete gzip stream"):
        read_idx(path, IDX_IMAGES_MAGIC)


def test_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gz"):
        read_idx(tmp_path / "nope.gz", IDX_LABELS_MAGIC)


# --- Fashion-MNIST files -------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_fake_fashion_mnist_reads_back(tmp_path, compress):
    write_fake_fashion_mnist(tmp_path, n_train=50, n_test=20, compress=compress)
    assert all(path.suffix == (".gz" if compress else "") for path in tmp_path.iterdir())
    arrays = read_fashion_mnist(tmp_path)
    assert arrays.train_images.shape == (50, 1, 28, 28) and arrays.train_images.dtype == torch.uint8
    assert arrays.test_images.shape == (20, 1, 28, 28)
    assert arrays.train_labels.dtype == torch.int64
    assert torch.bincount(arrays.train_labels, minlength=10).tolist() == [5] * 10


def test_fashion_mnist_rejects_count_mismatch(tmp_path):
    write_fake_fashion_mnist(tmp_path, n_train=60, n_test=10)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(50, dtype=np.uint8))
    expected = r"train split .*: 60 images in .*train-images.* but 50 labels in .*train-labels"
    with pytest.raises(ValueError, match=expected):
        read_fashion_mnist(tmp_path)


def test_fashion_mnist_rejects_label_out_of_range(tmp_path):
    write_fake_fashion_mnist(tmp_path, n_train=10, n_test=10)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.full(10, 10, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: label 10 outside 0\.\.9"):
        read_fashion_mnist(tmp_path)


def test_locator_search_order(tmp_path):
    root = write_fake_fashion_mnist(tmp_path / "root", 10, 10)
    data_dir = tmp_path / "data"
    system_dir = write_fake_fashion_mnist(tmp_path / "system", 10, 10)

    def locate(**kwargs):
        return locate_fashion_mnist(data_dir=data_dir, system_dir=system_dir, **kwargs)

    assert locate() == system_dir
    incomplete = data_dir / "fashion-mnist"
    write_fake_fashion_mnist(incomplete, 10, 10)
    (incomplete / "t10k-labels-idx1-ubyte.gz").unlink()
    assert locate() == system_dir  # an incomplete directory is passed over
    write_fake_fashion_mnist(incomplete, 10, 10)
    assert locate() == incomplete
    assert locate(root=root) == root
    with pytest.raises(FileNotFoundError, match=r"root=.*absent: directory does not exist"):
        locate(root=tmp_path / "absent")
    (root / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing train-images-idx3-ubyte\[\.gz\]"):
        locate(root=root)  # an explicit root never falls back


def test_missing_data_error_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        locate_fashion_mnist(data_dir=tmp_path / "data", system_dir=tmp_path / "system")
    message = str(error.value)
    for expected in ("make data", "apt-get install dataset-fashion-mnist", "download=True",
                     str(tmp_path / "data" / "fashion-mnist"), str(tmp_path / "system")):  # fmt: skip
        assert expected in message


def test_download_from_mirror(tmp_path):
    mirror = write_fake_fashion_mnist(tmp_path / "mirror", 20, 10)
    data_dir = tmp_path / "data"
    found = locate_fashion_mnist(data_dir=data_dir, download=True, system_dir=tmp_path / "none", mirror=mirror.as_uri())
    assert found == data_dir / "fashion-mnist"
    assert sorted(path.name for path in found.iterdir()) == sorted(path.name for path in mirror.iterdir())
    assert read_fashion_mnist(found).train_images.shape == (20, 1, 28, 28)


def test_failed_download_leaves_no_partial_files(tmp_path):
    mirror = tmp_path / "mirror"
    write_fake_fashion_mnist(mirror, 20, 10)
    (mirror / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(FileNotFoundError, match=r"(?s)Downloading Fashion-MNIST .* failed.*make data"):
        locate_fashion_mnist(
            data_dir=tmp_path / "data", download=True, system_dir=tmp_path / "none", mirror=mirror.as_uri()
        )
    left = sorted(path.name for path in (tmp_path / "data" / "fashion-mnist").iterdir())
    assert left == ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]  # complete files only


@pytest.mark.skipif(
    not SYSTEM_FASHION_MNIST_DIR.is_dir(), reason=f"{SYSTEM_FASHION_MNIST_DIR} absent (run `make data`)"
)
def test_real_fashion_mnist():
    arrays = load_fashion_mnist(root=SYSTEM_FASHION_MNIST_DIR)
    assert arrays.train_images.shape == (60000, 1, 28, 28) and arrays.test_images.shape == (10000, 1, 28, 28)
    assert torch.bincount(arrays.train_labels).tolist() == [6000] * 10
    assert torch.bincount(arrays.test_labels).tolist() == [1000] * 10
    pixels = arrays.train_images.float() / 255
    assert pixels.mean().item() == pytest.approx(FASHION_MNIST_MEAN[0], abs=1e-3)
    assert pixels.std().item() == pytest.approx(FASHION_MNIST_STD[0], abs=1e-3)


# --- transforms ----------------------------------------------------------------------------------


def test_random_crop_is_a_shift_of_the_padded_image():
    images = torch.randint(1, 256, (16, 2, 6, 5), dtype=torch.uint8)
    padding = 2
    cropped = random_crop(images, padding)
    assert cropped.shape == images.shape
    padded = torch.nn.functional.pad(images, (padding,) * 4)
    shifts = set()
    for original, crop in zip(padded, cropped, strict=True):
        offsets = [(dy, dx) for dy in range(2 * padding + 1) for dx in range(2 * padding + 1)
                   if torch.equal(original[:, dy : dy + 6, dx : dx + 5], crop)]  # fmt: skip
        assert len(offsets) == 1
        shifts.add(offsets[0])
    assert len(shifts) > 1, "each image draws its own shift"


def test_random_hflip_mirrors_some_images():
    images = torch.randint(0, 256, (64, 1, 4, 4), dtype=torch.uint8)
    flipped = random_hflip(images)
    same = (flipped == images).flatten(1).all(1)
    mirrored = (flipped == images.flip(-1)).flatten(1).all(1)
    assert bool((same | mirrored).all()) and 0 < int(mirrored.sum()) < 64


def test_batch_transform_normalises_and_resizes():
    transform = BatchTransform(mean=(0.5, 0.2), std=(0.25, 0.1), size=6)
    images = torch.empty(3, 2, 4, 4, dtype=torch.uint8)
    images[:, 0], images[:, 1] = round(0.75 * 255), round(0.1 * 255)  # mean + 1 std, mean - 1 std
    out = transform(images)
    assert out.shape == (3, 2, 6, 6) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, 0], torch.ones(3, 6, 6), atol=0.01, rtol=0)
    torch.testing.assert_close(out[:, 1], -torch.ones(3, 6, 6), atol=0.02, rtol=0)


# --- DataModule ----------------------------------------------------------------------------------


def test_properties_before_setup(tmp_path):
    module = ImageClassificationDataModule(dataset="fashion_mnist", data_dir=str(tmp_path))
    assert (module.num_classes, module.in_chans, module.img_size) == (10, 1, 28)
    assert module.mean == FASHION_MNIST_MEAN and module.std == FASHION_MNIST_STD
    cifar100 = ImageClassificationDataModule(dataset="cifar100", data_dir=str(tmp_path), img_size=64)
    assert (cifar100.num_classes, cifar100.in_chans, cifar100.img_size, len(cifar100.mean)) == (100, 3, 64, 3)


def test_split_is_disjoint_and_seeded(fake_dir):
    def split(seed, val_size=100):
        module = make_module(fake_dir, seed=seed, val_size=val_size)
        module.setup("fit")
        return module.train_indices, module.val_indices

    train, val = split(0)
    assert len(train) == N_TRAIN - 100 and len(val) == 100
    assert sorted(torch.cat([train, val]).tolist()) == list(range(N_TRAIN))
    assert torch.equal(split(0)[1], val)
    assert not torch.equal(split(1)[1], val)
    assert len(split(0, val_size=0.25)[1]) == N_TRAIN // 4


def test_batches_shape_dtype_and_normalisation(fake_dir):
    module = make_module(fake_dir, augment="none")
    images, labels = next(iter(module.train_dataloader()))
    assert images.shape == (32, 1, 28, 28) and images.dtype == torch.float32 and labels.dtype == torch.int64
    # The fake set has Fashion-MNIST's pixel mean and std: normalised data has mean ~0, std ~1.
    everything = torch.cat([batch for batch, _ in module.train_dataloader()])
    assert abs(everything.mean().item()) < 0.02 and abs(everything.std().item() - 1) < 0.02
    test_images, test_labels = map(torch.cat, zip(*module.test_dataloader()))
    assert test_images.shape == (N_TEST, 1, 28, 28)
    assert torch.equal(test_labels, read_fashion_mnist(fake_dir).test_labels)
    resized = make_module(fake_dir, img_size=32, eval_batch_size=50)
    assert next(iter(resized.val_dataloader()))[0].shape == (50, 1, 32, 32)


def test_train_loader_is_seeded(fake_dir):
    def first_labels(seed, num_workers=0):
        torch.manual_seed(0)  # augmentation in the main process draws from the global generator
        return [labels for _, labels in make_module(fake_dir, seed=seed, num_workers=num_workers).train_dataloader()]

    assert all(torch.equal(a, b) for a, b in zip(first_labels(0), first_labels(0), strict=True))
    assert not torch.equal(first_labels(0)[0], first_labels(1)[0])
    loader = make_module(fake_dir, num_workers=2).train_dataloader()
    assert loader.persistent_workers
    with_workers = [next(iter(make_module(fake_dir, num_workers=2).train_dataloader())) for _ in range(2)]
    assert torch.equal(with_workers[0][0], with_workers[1][0])  # worker seeds come from the loader's generator


def test_augmentation(fake_dir):
    plain = make_module(fake_dir, augment="none")
    plain.setup()
    indices = list(range(64))
    assert torch.equal(plain.train_set.__getitems__(indices)[0], plain.train_set.__getitems__(indices)[0])
    augmented = make_module(fake_dir, augment="basic")
    augmented.setup()
    first, second = augmented.train_set.__getitems__(indices)[0], augmented.train_set.__getitems__(indices)[0]
    assert first.shape == second.shape == (64, 1, 28, 28)
    assert not torch.equal(first, second)
    assert torch.equal(augmented.val_set.__getitems__(indices)[0], plain.val_set.__getitems__(indices)[0])


def test_fewshot_arrays(fake_dir):
    module = make_module(fake_dir, augment="basic")
    images, labels = module.fewshot_arrays(shots=3, seed=0)
    assert images.shape == (30, 1, 28, 28) and images.dtype == torch.float32
    assert torch.bincount(labels, minlength=10).tolist() == [3] * 10
    again, _ = module.fewshot_arrays(shots=3, seed=0)
    other, _ = module.fewshot_arrays(shots=3, seed=1)
    assert torch.equal(images, again) and not torch.equal(images, other)
    # Drawn from the training split only, without augmentation.
    plain = make_module(fake_dir, augment="none")
    plain.setup()
    train_images, _ = plain.train_set.__getitems__(range(len(plain.train_set)))
    val_images, _ = plain.val_set.__getitems__(range(len(plain.val_set)))
    assert all((train_images == image).flatten(1).all(1).any() for image in images)
    assert not any((val_images == image).flatten(1).all(1).any() for image in images)
    with pytest.raises(ValueError, match="fewer than shots=1000"):
        module.fewshot_arrays(shots=1000, seed=0)


def test_limit_train_samples(fake_dir):
    module = make_module(fake_dir, limit_train_samples=70)
    module.setup()
    assert len(module.train_set) == 70 and len(module.val_set) == 100
    assert sum(len(labels) for _, labels in module.train_dataloader()) == 70


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset": "mnist"}, r"dataset='mnist' is not supported; choose one of \['cifar10', 'cifar100', 'fashion_"),
        ({"root": "/no/such/dir"}, r"root='/no/such/dir' does not exist"),
        ({"img_size": 0}, r"img_size=0 must be a positive integer"),
        ({"img_size": -3}, r"img_size=-3 must be a positive integer"),
        ({"augment": "heavy"}, r"augment='heavy' is not supported; choose one of \['none', 'basic'\]"),
        ({"auto_augment": "rand-m9"}, r"auto_augment='rand-m9' applies to dataset='imagefolder' only"),
        ({"val_size": 1.5}, r"val_size=1.5 must be a count >= 0 or a fraction in \[0, 1\)"),
        ({"dataset": "imagefolder"}, r"dataset='imagefolder' needs root="),
        ({"pin_memory": "no"}, r"pin_memory='no' must be true or false"),
        ({"download": "no"}, r"download='no' must be true or false"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImageClassificationDataModule(**kwargs)


def test_val_size_larger_than_training_set(fake_dir):
    module = make_module(fake_dir, val_size=N_TRAIN)
    with pytest.raises(ValueError, match=rf"val_size={N_TRAIN} leaves no training data: .* has {N_TRAIN} examples"):
        module.setup()


def test_no_validation_split(fake_dir):
    module = make_module(fake_dir, val_size=0)
    assert module.val_dataloader() == [] and len(module.train_set) == N_TRAIN


def test_a_small_validation_fraction_holds_out_at_least_one_example(fake_dir):
    """0.0005 of 600 examples rounds to none: validation (and the best-epoch checkpoint it feeds) was silently off."""
    module = make_module(fake_dir, val_size=0.0005)
    module.setup("fit")
    assert len(module.val_indices) == 1 and len(module.train_set) == N_TRAIN - 1
    assert len(module.val_dataloader()) == 1


# --- CIFAR and ImageFolder -----------------------------------------------------------------------


def test_cifar_absent_offline(tmp_path):
    expected = rf"cifar10 not found .*{re.escape(str(tmp_path / 'cifar-10-batches-py'))}.*download=True"
    with pytest.raises(FileNotFoundError, match=expected):
        load_cifar("cifar10", tmp_path)
    module = ImageClassificationDataModule(dataset="cifar100", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="cifar-100-python"):
        module.setup()


def test_cifar_layout_and_normalisation(tmp_path, monkeypatch):
    class FakeCIFAR10:
        """torchvision's CIFAR10 attributes: data [N, 32, 32, 3] uint8, targets list[int], classes."""

        classes = [f"class{i}" for i in range(10)]

        def __init__(self, root, train, download):
            n = 40 if train else 20
            self.data = np.zeros((n, 32, 32, 3), dtype=np.uint8)
            self.data[..., 1] = 255  # green only
            self.targets = [i % 10 for i in range(n)]

    monkeypatch.setitem(cifar.CIFAR_CLASSES, "cifar10", FakeCIFAR10)
    arrays = load_cifar("cifar10", tmp_path)
    assert arrays.train_images.shape == (40, 3, 32, 32) and arrays.test_labels.shape == (20,)
    assert arrays.train_images[:, 1].eq(255).all() and arrays.train_images[:, [0, 2]].eq(0).all()
    assert arrays.class_names == tuple(FakeCIFAR10.classes)
    module = ImageClassificationDataModule(dataset="cifar10", data_dir=str(tmp_path), val_size=10, batch_size=8)
    images, labels = next(iter(module.train_dataloader()))
    assert module.label_names == tuple(FakeCIFAR10.classes), "the dataset's names, for checkpoints and predict.py"
    assert images.shape == (8, 3, 32, 32) and labels.dtype == torch.int64
    test_images = torch.cat([images for images, _ in module.test_dataloader()])
    expected = [(value - mean) / std for value, mean, std in zip((0.0, 1.0, 0.0), module.mean, module.std, strict=True)]
    torch.testing.assert_close(test_images.mean(dim=(0, 2, 3)), torch.tensor(expected), atol=1e-4, rtol=0)


def make_image_folder(root: Path, splits=("train", "val"), per_class=4) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in splits:
        for label in ("cat", "dog"):
            (root / split / label).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")
    return root


def test_imagefolder(tmp_path):
    root = make_image_folder(tmp_path / "tree")
    module = ImageClassificationDataModule(
        dataset="imagefolder", root=str(root), img_size=32, batch_size=4, auto_augment="rand-m9-mstd0.5-inc1"
    )
    assert (module.num_classes, module.in_chans, module.img_size) == (2, 3, 32)
    images, labels = next(iter(module.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert len(module.val_set) == len(module.test_set) == 8  # test falls back to val/
    fewshot_images, fewshot_labels = module.fewshot_arrays(shots=2, seed=0)
    assert fewshot_images.shape == (4, 3, 32, 32) and fewshot_labels.tolist() == [0, 0, 1, 1]


def test_imagefolder_missing_split(tmp_path):
    root = make_image_folder(tmp_path / "tree", splits=("train",), per_class=1)
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(root / 'val'))} is not a directory"):
        ImageClassificationDataModule(dataset="imagefolder", root=str(root))


# --- Hydra configs -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fashion_mnist", "cifar10", "cifar100", "imagefolder"])
def test_configs_instantiate(tmp_path, name):
    data_config = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
    config = OmegaConf.create({"paths": {"data_dir": str(tmp_path)}, "data": data_config})
    if name == "imagefolder":
        tree = make_image_folder(tmp_path / "tree", per_class=1)
        config.data.root = str(tree)
        config.data.num_classes = len(list((tree / "train").iterdir()))
    module = instantiate(config.data)
    assert module.num_classes == config.data.num_classes and module.in_chans == config.data.in_chans
    assert isinstance(module, ImageClassificationDataModule)
    assert module.dataset == name and module.data_dir == tmp_path and module.seed == 0


def test_config_facts_must_match_the_dataset(tmp_path):
    write_fake_fashion_mnist(tmp_path / "fm", n_train=20, n_test=10)
    with pytest.raises(ValueError, match="data.num_classes=100 but dataset 'fashion_mnist' has 10"):
        ImageClassificationDataModule(dataset="fashion_mnist", root=str(tmp_path / "fm"), num_classes=100)
    with pytest.raises(ValueError, match="data.in_chans=3"):
        ImageClassificationDataModule(dataset="fashion_mnist", root=str(tmp_path / "fm"), in_chans=3)
