"""Soft MoE slot pictures: the dispatch weights drawn land on the patches they weigh (class token and
conv stem included), the pictures of a trained checkpoint (script function, TensorBoard callback),
and the refusal of models without Soft MoE."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import moekit.models  # noqa: F401  (registers the models with timm)
from conftest import compose_config, run_script
from moekit.callbacks import SlotPictureLogger
from moekit.callbacks.slots import (
    dispatch_weights,
    heat_colormap,
    heat_overlay,
    pick_images,
    select_slots,
    select_soft_moe_layer,
    slot_maps,
    slot_picture_grid,
    slot_pictures,
)
from moekit.commands.plot_slots import plot_slots
from moekit.commands.train import train
from moekit.data.fashion_mnist import write_fake_fashion_mnist


def tiny_soft_moe_vit(**overrides) -> torch.nn.Module:
    """A 2-block Soft MoE ViT for 1 x 28 x 28 images: conv stem to 7 x 7 patches, class token."""
    moe = {"num_experts": 4, "capacity_factor": None, "slots_per_expert": 2}  # 8 slots
    kwargs = dict(embed_dim=32, depth=2, num_heads=2, moe=moe, stem="conv", class_token=True, global_pool="token")
    return timm.create_model("soft_moe_vit_tiny_patch4_28", **{**kwargs, **overrides}).eval()


def luminance(pictures: torch.Tensor) -> torch.Tensor:
    """``[..., 3, H, W]`` -> ``[..., H, W]``."""
    return pictures.mean(dim=-3)


# ---------------------------------------------------------------------------------------------
def test_a_slot_concentrated_on_one_patch_is_brightest_over_that_patch():
    model = tiny_soft_moe_vit()
    _, layer = select_soft_moe_layer(model)
    row, col, slot = 2, 5, 3
    token = model.num_prefix_tokens + row * 7 + col

    def craft(module, args):  # token `token` alone points along e_0, which is slot `slot`'s direction
        x = args[0].clone()
        x[..., 0] = 0.0
        x[:, token] = 0.0
        x[:, token, 0] = 1.0
        return (x,)

    with torch.no_grad():
        layer.phi.zero_()
        layer.phi[0, slot] = 1.0
        layer.scale.fill_(50.0)
    layer.register_forward_pre_hook(craft)
    images = torch.randn(2, 1, 28, 28)
    upscale = 2
    pictures = slot_pictures(model, images, slots=[slot, 0], upscale=upscale)
    assert pictures.shape == (2, 3, 3, 56, 56)  # image, slot 3, slot 0

    patch = 4 * upscale  # pixels per patch in the picture
    for b in range(2):
        bright = luminance(pictures[b, 1])  # [56, 56]
        block = bright[row * patch : (row + 1) * patch, col * patch : (col + 1) * patch]
        outside = bright.clone()
        outside[row * patch : (row + 1) * patch, col * patch : (col + 1) * patch] = -1.0
        assert block.min() > outside.max(), "the slot's patch is brighter than every other pixel"
        per_patch = bright.unfold(0, patch, patch).unfold(1, patch, patch).mean(dim=(-1, -2))  # [7, 7]
        assert divmod(int(per_patch.argmax()), 7) == (row, col)
    # the first column is the image itself, min-max scaled
    assert torch.allclose(luminance(pictures[0, 0])[::upscale, ::upscale], _minmax(images[0, 0]), atol=1e-6)


def _minmax(image: torch.Tensor) -> torch.Tensor:
    return (image - image.min()) / (image.max() - image.min())


def test_slot_maps_leave_out_the_class_token():
    model = tiny_soft_moe_vit()
    _, layer = select_soft_moe_layer(model)
    with torch.no_grad():  # every slot's logits 0: a uniform dispatch over the 1 + 49 tokens
        layer.phi.zero_()
    maps, chosen = slot_maps(model, torch.randn(3, 1, 28, 28), slots=2)
    assert chosen == [0, layer.num_slots - 1]
    assert maps.shape == (3, 2, 7, 7)
    torch.testing.assert_close(maps, torch.full_like(maps, 1 / 50))  # the class token keeps 1 / 50


def test_dispatch_weights_are_the_ones_the_forward_used():
    model = tiny_soft_moe_vit(class_token=False, global_pool="avg", stem="patch")
    images = torch.randn(4, 1, 28, 28)
    weights = dispatch_weights(model, images, layer=0)
    assert weights.shape == (4, 49, 8)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(4, 8))
    _, first = select_soft_moe_layer(model, 0)
    # the layer's statistics come from the dispatch weights of that same forward
    torch.testing.assert_close(first.stats["max_dispatch_weight"], weights.amax(dim=1).mean())


def test_grid_follows_the_patch_embedding():
    model = tiny_soft_moe_vit(stem="patch", patch_size=7)
    maps, _ = slot_maps(model, torch.randn(1, 1, 28, 28), slots=1)
    assert maps.shape == (1, 1, 4, 4)
    grid = slot_picture_grid(model, torch.randn(2, 1, 28, 28), slots=3, upscale=1, padding=2)
    assert grid.shape == (3, 2 * (28 + 2) + 2, 4 * (28 + 2) + 2)


def test_heat_colormap_brightens_with_the_weight_and_overlay_stays_in_range():
    values = torch.linspace(0, 1, 101)
    bright = heat_colormap(values).mean(dim=-1)
    assert torch.all(bright[1:] >= bright[:-1]) and bright[0] == 0 and bright[-1] == 1
    overlay = heat_overlay(torch.randn(2, 3, 8, 8), torch.rand(2, 5, 2, 2))
    assert overlay.shape == (2, 5, 3, 8, 8) and overlay.min() >= 0 and overlay.max() <= 1


@pytest.mark.e2e
def test_bad_choices_are_named():
    model = tiny_soft_moe_vit()
    with pytest.raises(ValueError, match="slots=9 must be a count in"):
        select_slots(9, 8)
    with pytest.raises(ValueError, match="slot index 8 is out of range"):
        select_slots([0, 8], 8)
    with pytest.raises(ValueError, match="layer='blocks.0.mlp' is not a Soft MoE layer"):
        select_soft_moe_layer(model, "blocks.0.mlp")
    dense = timm.create_model("vit_tiny_patch4_28", embed_dim=32, depth=2, num_heads=2)
    with pytest.raises(ValueError, match="no Soft MoE layer"):
        select_soft_moe_layer(dense)
    module = torch.nn.Module()
    module.net = dense
    with pytest.raises(ValueError, match="no Soft MoE layer"):
        SlotPictureLogger().setup(None, module, "fit")
    # refused when the callback is built, not after the first validation epoch of a run
    with pytest.raises(ValueError, match=r"alpha=1.5 must lie in \[0, 1\]"):
        SlotPictureLogger(alpha=1.5)
    with pytest.raises(ValueError, match="upscale=0 must be an int >= 1"):
        SlotPictureLogger(upscale=0)


def test_more_images_than_the_validation_split_holds_stop_the_run_before_training(tmp_path):
    """``num_images=4`` of a 3-image validation split: refused at the sanity-check validation, before the first
    training step, not once the first training epoch has ended."""
    from lightning import LightningModule, Trainer
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    class Task(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_soft_moe_vit()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def loader(n: int) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(n, 1, 28, 28), torch.zeros(n, dtype=torch.long)), batch_size=3)

    trainer = Trainer(
        max_epochs=1,
        logger=TensorBoardLogger(tmp_path),
        callbacks=[SlotPictureLogger(num_images=4)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"num_images=4 must be an int in \[1, 3\]"):
        trainer.fit(Task(), loader(6), loader(3))
    assert trainer.global_step == 0


# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake_fashion(tmp_path_factory) -> Path:
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("fm") / "fashion-mnist", n_train=256, n_test=32)


def _train_tiny(experiment: str, data_root: Path, out: Path, extra: list[str] = ()) -> Path:
    overrides = [
        f"experiment={experiment}",
        f"data.root={data_root}",
        "data.val_size=64",
        "debug=tiny",
        "data.batch_size=64",
        "trainer.precision=32-true",
        "test=false",
        *extra,
    ]
    train(compose_config("train", overrides, out))
    return next((out / "checkpoints").glob("epoch_*.ckpt"))


def test_pictures_from_a_trained_checkpoint_and_in_tensorboard(fake_fashion, tmp_path):
    ckpt = _train_tiny(
        "soft_moe_vit",
        fake_fashion,
        tmp_path / "run",
        ["callbacks=[default,slot_pictures]", "logger=tensorboard", "callbacks.slot_pictures.num_images=2"],
    )
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert "slots/dispatch" in events.Tags()["images"]
    logged = events.Images("slots/dispatch")[-1]
    assert logged.step == events.Scalars("val/loss")[-1].step  # the step axis of Lightning's metrics
    assert (logged.width, logged.height) == (5 * (28 * 4 + 2) + 2, 2 * (28 * 4 + 2) + 2)  # 2 rows, image + 4 slots

    out = tmp_path / "pictures" / "slots.png"
    cfg = compose_config(
        "plot_slots", [f"ckpt_path={ckpt}", f"out={out}", "num_images=3", "slots=[0,5]", "upscale=2"], tmp_path
    )
    assert plot_slots(cfg) == out
    cell = 28 * 2 + 2
    assert Image.open(out).size == (3 * cell + 2, 3 * cell + 2)  # 3 images x (image + 2 slots)


@pytest.mark.e2e
def test_plot_slots_refuses_a_dense_checkpoint(fake_fashion, tmp_path):
    ckpt = _train_tiny("dense_vit", fake_fashion, tmp_path / "run", ["logger=csv"])
    result = run_script("plot_slots.py", f"ckpt_path={ckpt}", f"out={tmp_path / 'x.png'}", cwd=tmp_path)
    assert result.returncode == 1
    assert "no Soft MoE layer" in result.stderr + result.stdout
    assert not (tmp_path / "x.png").exists()


def test_a_bool_is_not_taken_for_a_count():
    """``num_images: true`` or ``every_n_epochs: true`` in a config is a typo, not 1; ``slots=[0, True]`` is not
    slot 1."""
    with pytest.raises(ValueError, match="num_images=True must be an int >= 1"):
        SlotPictureLogger(num_images=True)
    with pytest.raises(ValueError, match="every_n_epochs=True must be an int >= 1"):
        SlotPictureLogger(every_n_epochs=True)
    with pytest.raises(ValueError, match=r"slots=True; give a count of slots or a list of slot indices"):
        select_slots(True, 8)
    with pytest.raises(ValueError, match="slot index True is out of range"):
        select_slots([0, True], 8)
    with pytest.raises(ValueError, match=r"num_images=True must be an int in \[1, 3\]"):
        pick_images(torch.utils.data.TensorDataset(torch.zeros(3, 1, 4, 4)), True)
