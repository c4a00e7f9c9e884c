"""Soft MoE slot pictures (Puigcerver et al., Figure 10): where each slot takes its input from.

A Soft MoE slot's input is a convex combination of the tokens, with the dispatch weights ``D[:, s]``
(a softmax over tokens). For a ViT the patch tokens form a grid, so a slot's weights drawn over the
image show what it looks at. Here:

* :func:`dispatch_weights` runs the model and returns the dispatch weights ``[B, M, S]`` of one Soft MoE
  layer (default the last), recomputed from the layer's input by a temporary forward hook: the layer
  itself is unchanged and keeps nothing (in eval mode the routing has no noise, so these are exactly
  the weights its forward used);
* :func:`slot_maps` keeps the chosen slots' weights on the patch tokens - prefix tokens (class,
  register) have no place on the image and are left out - as ``[B, K, grid_h, grid_w]``, the grid
  taken from the model's ``patch_embed`` (linear patchify or conv stem alike);
* :func:`heat_overlay` upsamples them (nearest: one block per patch) and blends a heat map over the
  image; :func:`slot_pictures` / :func:`slot_picture_grid` put it together, one row per image: the
  image, then one picture per slot.

:class:`SlotPictureLogger` logs such a grid to TensorBoard after every validation epoch, for a few
validation images picked once (evenly spaced through the split, :func:`pick_images`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchvision.utils import make_grid

from moekit.loggers import logging_step
from moekit.moe import SoftMoE, moe_layers

__all__ = [
    "soft_moe_layers",
    "select_soft_moe_layer",
    "select_slots",
    "dispatch_weights",
    "patch_grid_size",
    "slot_maps",
    "heat_colormap",
    "heat_overlay",
    "slot_pictures",
    "slot_picture_grid",
    "pick_images",
    "SlotPictureLogger",
]

SlotChoice = int | Sequence[int]

# A black -> red -> yellow -> white ramp: brightness rises with the weight.
_HEAT_STOPS = torch.tensor([0.0, 0.35, 0.7, 1.0])
_HEAT_COLOURS = torch.tensor([[0.0, 0.0, 0.0], [0.85, 0.08, 0.0], [1.0, 0.75, 0.0], [1.0, 1.0, 1.0]])


def soft_moe_layers(model: nn.Module) -> dict[str, SoftMoE]:
    """``{qualified name: layer}`` of every :class:`~moekit.moe.SoftMoE` layer of ``model``, in order."""
    return {name: layer for name, layer in moe_layers(model) if isinstance(layer, SoftMoE)}


def select_soft_moe_layer(model: nn.Module, layer: str | int | None = None) -> tuple[str, SoftMoE]:
    """One Soft MoE layer of ``model``: by qualified name (``"blocks.5.mlp"``), by position among the
    Soft MoE layers (``-1`` = last, ``0`` = first), or the last one when ``layer`` is None.

    Raises:
        ValueError: ``model`` has no Soft MoE layer, or ``layer`` names none of them.
    """
    layers = soft_moe_layers(model)
    if not layers:
        found = sorted({type(m).__name__ for _, m in moe_layers(model)})
        raise ValueError(
            f"{type(model).__name__} has no Soft MoE layer (MoE layers found: {found or 'none, a dense model'}); "
            "slot pictures show Soft MoE dispatch weights: use a Soft MoE model (e.g. experiment=soft_moe_vit)"
        )
    names = list(layers)
    if layer is None:
        layer = -1
    if isinstance(layer, int) and not isinstance(layer, bool):
        if not -len(names) <= layer < len(names):
            raise ValueError(f"layer={layer} is out of range: the model has {len(names)} Soft MoE layers {names}")
        name = names[layer]
    elif layer in layers:
        name = layer
    else:
        raise ValueError(f"layer={layer!r} is not a Soft MoE layer of the model; choose one of {names} or an index")
    return name, layers[name]


def select_slots(slots: SlotChoice, num_slots: int) -> list[int]:
    """Slot indices from a count (that many, evenly spaced over all slots, so different experts show)
    or an explicit list (negative indices count from the end)."""
    if isinstance(slots, int) and not isinstance(slots, bool):
        if not 1 <= slots <= num_slots:
            raise ValueError(f"slots={slots} must be a count in [1, {num_slots}] (the layer has {num_slots} slots)")
        return torch.linspace(0, num_slots - 1, slots).round().long().tolist()
    if isinstance(slots, bool) or not isinstance(slots, Sequence) or isinstance(slots, str):
        raise ValueError(f"slots={slots!r}; give a count of slots or a list of slot indices")
    chosen = list(slots)
    if not chosen:
        raise ValueError("slots=[] selects no slot; give a count or a list of slot indices")
    for s in chosen:
        if not (isinstance(s, int) and not isinstance(s, bool) and -num_slots <= s < num_slots):
            raise ValueError(f"slot index {s!r} is out of range: the layer has {num_slots} slots (0..{num_slots - 1})")
    return [s % num_slots for s in chosen]


@torch.no_grad()
def dispatch_weights(model: nn.Module, images: Tensor, layer: str | int | None = None) -> Tensor:
    """Dispatch weights ``[B, M, S]`` (float32; ``M`` tokens, prefix tokens first; each slot's column
    sums to 1 over tokens) of the chosen Soft MoE layer when ``model`` (in eval mode) runs on
    ``images [B, C, H, W]``. Under FSDP or expert parallelism the forward holds collectives: every rank
    must call this together."""
    _, soft_moe = select_soft_moe_layer(model, layer)
    captured: list[Tensor] = []

    def capture(module: SoftMoE, args: tuple, kwargs: dict[str, Any], output: Tensor) -> None:
        x = args[0] if args else kwargs["x"]
        padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        captured.append(module.routing_weights(x, padding_mask)[0].float())

    was_training = model.training
    # prepend: run before FSDP's own post-forward hook reshards the layer's parameters
    handle = soft_moe.register_forward_hook(capture, with_kwargs=True, prepend=True)
    try:
        model.eval()
        model(images)
    finally:
        handle.remove()
        model.train(was_training)
    if not captured:
        raise ValueError(f"the Soft MoE layer {layer!r} did not run in the model's forward")
    return captured[-1]


def patch_grid_size(model: nn.Module, image_size: tuple[int, int]) -> tuple[int, int]:
    """``(grid_h, grid_w)`` of the patch tokens for images of ``image_size`` (H, W), from the model's
    ``patch_embed`` (timm ``PatchEmbed`` or the conv stem, fixed or dynamic image size)."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is None or getattr(patch_embed, "grid_size", None) is None:
        raise ValueError(
            f"{type(model).__name__} has no patch_embed with a grid_size: slot pictures need a ViT whose tokens "
            "are image patches"
        )
    if getattr(patch_embed, "dynamic_img_size", False):
        return tuple(patch_embed.dynamic_feat_size(image_size))
    return tuple(patch_embed.grid_size)


@torch.no_grad()
def slot_maps(
    model: nn.Module, images: Tensor, slots: SlotChoice = 4, layer: str | int | None = None
) -> tuple[Tensor, list[int]]:
    """Dispatch weights of the chosen slots on the patch grid.

    Returns:
        ``(maps [B, K, grid_h, grid_w], slot_indices)``: ``maps[b, k]`` are slot ``slot_indices[k]``'s
        weights on image ``b``'s patches (prefix tokens left out, so a row sums to at most 1).
    """
    weights = dispatch_weights(model, images, layer)  # [B, M, S]
    grid_h, grid_w = patch_grid_size(model, tuple(images.shape[-2:]))
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    patches = weights.shape[1] - prefix
    if patches != grid_h * grid_w:
        raise ValueError(
            f"the Soft MoE layer saw {weights.shape[1]} tokens = {prefix} prefix + {patches} others, but the patch "
            f"grid is {grid_h} x {grid_w} = {grid_h * grid_w}: its tokens are not the image patches"
        )
    chosen = select_slots(slots, weights.shape[2])
    maps = weights[:, prefix:, chosen]  # [B, P, K]
    return maps.transpose(1, 2).reshape(images.shape[0], len(chosen), grid_h, grid_w), chosen


def heat_colormap(values: Tensor) -> Tensor:
    """``[...]`` values in ``[0, 1]`` -> ``[..., 3]`` RGB on a black-red-yellow-white ramp (brightness
    increases with the value)."""
    stops, colours = _HEAT_STOPS.to(values.device), _HEAT_COLOURS.to(values.device)
    values = values.clamp(0, 1)
    upper = torch.searchsorted(stops, values.contiguous(), right=False).clamp(1, len(stops) - 1)
    lo, hi = stops[upper - 1], stops[upper]
    t = ((values - lo) / (hi - lo)).unsqueeze(-1)
    return colours[upper - 1] * (1 - t) + colours[upper] * t


def _display_rgb(images: Tensor) -> Tensor:
    """``[B, C, H, W]`` model inputs (normalised) -> ``[B, 3, H, W]`` in ``[0, 1]``, each image min-max
    scaled; one channel is repeated, other channel counts are averaged to grey."""
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    elif images.shape[1] != 3:
        images = images.mean(dim=1, keepdim=True).expand(-1, 3, -1, -1)
    flat = images.reshape(images.shape[0], -1)
    low = flat.min(dim=1).values.view(-1, 1, 1, 1)
    high = flat.max(dim=1).values.view(-1, 1, 1, 1)
    return (images - low) / (high - low).clamp_min(1e-8)


def heat_overlay(images: Tensor, maps: Tensor, alpha: float = 0.6) -> Tensor:
    """Blend heat maps over images.

    Args:
        images: ``[B, C, H, W]`` (any range: min-max scaled per image for display).
        maps: ``[B, K, grid_h, grid_w]`` non-negative weights; each map is scaled by its maximum, then
            upsampled to ``H x W`` by repetition (one block per patch).
        alpha: heat map opacity in ``[0, 1]``.

    Returns:
        ``[B, K, 3, H, W]`` in ``[0, 1]``: ``(1 - alpha) * image + alpha * colormap(map)``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must lie in [0, 1] (the heat map's opacity)")
    if maps.shape[0] != images.shape[0]:
        raise ValueError(f"maps for {maps.shape[0]} images but {images.shape[0]} images")
    height, width = images.shape[-2:]
    peak = maps.flatten(2).amax(dim=2).clamp_min(torch.finfo(maps.dtype).tiny)
    scaled = maps / peak[:, :, None, None]
    upsampled = F.interpolate(scaled.float(), size=(height, width), mode="nearest")  # [B, K, H, W]
    heat = heat_colormap(upsampled).permute(0, 1, 4, 2, 3)  # [B, K, 3, H, W]
    base = _display_rgb(images.float()).unsqueeze(1)  # [B, 1, 3, H, W]
    return (1 - alpha) * base + alpha * heat


@torch.no_grad()
def slot_pictures(
    model: nn.Module,
    images: Tensor,
    slots: SlotChoice = 4,
    layer: str | int | None = None,
    upscale: int = 4,
    alpha: float = 0.6,
) -> Tensor:
    """``[B, 1 + K, 3, H * upscale, W * upscale]``: per image, the image itself then the dispatch weights
    of ``K`` slots of one Soft MoE layer (:func:`slot_maps`) over it (:func:`heat_overlay`)."""
    if not (isinstance(upscale, int) and upscale >= 1):
        raise ValueError(f"upscale={upscale!r} must be an int >= 1 (pixels per image pixel)")
    maps, _ = slot_maps(model, images, slots, layer)
    overlays = heat_overlay(images, maps.to(images.device), alpha)
    pictures = torch.cat([_display_rgb(images.float()).unsqueeze(1), overlays], dim=1)
    if upscale > 1:
        pictures = pictures.repeat_interleave(upscale, dim=-2).repeat_interleave(upscale, dim=-1)
    return pictures


def slot_picture_grid(
    model: nn.Module,
    images: Tensor,
    slots: SlotChoice = 4,
    layer: str | int | None = None,
    upscale: int = 4,
    alpha: float = 0.6,
    padding: int = 2,
) -> Tensor:
    """The :func:`slot_pictures` as one image ``[3, H_grid, W_grid]``: a row per image, its first column
    the image, then one column per slot; ``padding`` white pixels between cells."""
    pictures = slot_pictures(model, images, slots, layer, upscale, alpha)
    return make_grid(pictures.flatten(0, 1).cpu(), nrow=pictures.shape[1], padding=padding, pad_value=1.0)


def pick_images(dataset: Dataset, num_images: int) -> Tensor:
    """``num_images`` images ``[N, C, H, W]`` evenly spaced through ``dataset`` (items ``(image, label)``),
    the same ones every call."""
    size = len(dataset)
    if not (isinstance(num_images, int) and not isinstance(num_images, bool) and 1 <= num_images <= size):
        raise ValueError(f"num_images={num_images!r} must be an int in [1, {size}] (the split has {size} images)")
    indices = torch.linspace(0, size - 1, num_images).round().long().tolist()
    images = []
    for index in indices:
        item = dataset[index]
        image = item[0] if isinstance(item, (tuple, list)) else item
        if not isinstance(image, Tensor) or image.dim() != 3:
            raise ValueError(f"dataset item {index} holds {type(image).__name__}, not an image tensor [C, H, W]")
        images.append(image)
    return torch.stack(images)


class SlotPictureLogger(Callback):
    """Log Soft MoE slot pictures (:func:`slot_picture_grid`) to TensorBoard after validation epochs.

    Args:
        num_images: validation images, picked once (evenly spaced through the validation split).
        slots: a count of slots (evenly spaced over the layer's slots) or a list of slot indices.
        layer: the Soft MoE layer: qualified name in the network, index among its Soft MoE layers, or
            None for the last.
        every_n_epochs: log after every n-th validation epoch.
        upscale: each image pixel becomes ``upscale x upscale`` pixels (small images stay legible).
        alpha: heat map opacity.
        tag: TensorBoard image tag.
    """

    def __init__(
        self,
        num_images: int = 4,
        slots: SlotChoice = 4,
        layer: str | int | None = None,
        every_n_epochs: int = 1,
        upscale: int = 4,
        alpha: float = 0.6,
        tag: str = "slots/dispatch",
    ) -> None:
        if not (isinstance(num_images, int) and not isinstance(num_images, bool) and num_images >= 1):
            raise ValueError(f"SlotPictureLogger: num_images={num_images!r} must be an int >= 1")
        if not (isinstance(every_n_epochs, int) and not isinstance(every_n_epochs, bool) and every_n_epochs >= 1):
            raise ValueError(f"SlotPictureLogger: every_n_epochs={every_n_epochs!r} must be an int >= 1")
        # checked here, not when the first validation epoch has ended and the pictures are drawn
        if not (isinstance(upscale, int) and not isinstance(upscale, bool) and upscale >= 1):
            raise ValueError(f"SlotPictureLogger: upscale={upscale!r} must be an int >= 1 (pixels per image pixel)")
        if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0.0 <= alpha <= 1.0):
            raise ValueError(f"SlotPictureLogger: alpha={alpha!r} must lie in [0, 1] (the heat map's opacity)")
        self.num_images = num_images
        self.slots = slots if isinstance(slots, int) else list(slots)
        self.layer = layer
        self.every_n_epochs = every_n_epochs
        self.upscale = upscale
        self.alpha = alpha
        self.tag = tag
        self._images: Tensor | None = None
        self._warned = False

    @staticmethod
    def _network(pl_module: LightningModule) -> nn.Module:
        return getattr(pl_module, "net", pl_module)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        net = self._network(pl_module)
        _, layer = select_soft_moe_layer(net, self.layer)  # refuse models without Soft MoE before training
        select_slots(self.slots, layer.num_slots)

    def _validation_images(self, trainer: Trainer) -> Tensor:
        if self._images is None:
            loaders = trainer.val_dataloaders
            loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
            self._images = pick_images(loader.dataset, self.num_images)
        return self._images

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Pick the images at the first validation (the sanity check before training): a ``num_images`` the
        validation split cannot give stops the run there, not after its first training epoch."""
        if self._images is None and any(isinstance(logger, TensorBoardLogger) for logger in trainer.loggers):
            self._validation_images(trainer)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Draw the slot pictures and log them to the TensorBoard loggers, at the step Lightning logs its
        own metrics at. Every rank runs the forward on the same images: under FSDP (parameter all-gathers)
        or expert parallelism (expert all-to-all) it holds collectives that all ranks must join; only rank 0
        draws and logs."""
        if trainer.sanity_checking or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not loggers:  # the same loggers on every rank: all ranks skip the forward together
            if not self._warned:
                rank_zero_warn("SlotPictureLogger: no TensorBoardLogger among the loggers; no slot pictures logged")
                self._warned = True
            return
        images = self._validation_images(trainer).to(pl_module.device)
        network = self._network(pl_module)
        with trainer.precision_plugin.forward_context():
            if not trainer.is_global_zero:
                dispatch_weights(network, images, self.layer)  # the forward rank 0 runs, for its collectives
                return
            grid = slot_picture_grid(network, images, self.slots, self.layer, self.upscale, self.alpha)
        for logger in loggers:
            logger.experiment.add_image(self.tag, grid, global_step=logging_step(trainer))
