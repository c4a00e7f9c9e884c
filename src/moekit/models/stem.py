"""The ViTs' two patch embeddings (``stem="patch"`` and ``stem="conv"``), drop-in ``embed_layer``s of timm's
``VisionTransformer``.

``MatmulPatchEmbed`` is timm's ``PatchEmbed`` (a ``patch x patch`` convolution of stride ``patch``) whose convolution
runs as one matmul of the image's patches against its flattened weight on the devices where that was measured to be
faster, GPUs (``PATCHIFY_KERNELS`` of :mod:`moekit.moe.kernel_choices`, with the measurements): the same parameters
(names, shapes, initial values), checkpoints and outputs.

The convolutional stem is for ViTs on small images (Xiao et al. 2021, "Early Convolutions Help
Transformers See Better").

``ConvStemPatchEmbed`` replaces timm ``PatchEmbed``'s single ``patch x patch`` projection by
``log2(patch)`` 3x3 stride-2 convolutions (BatchNorm, ReLU), optionally more 3x3 stride-1 ones at the token
resolution, and a 1x1 projection to ``embed_dim``:
same token grid, same interface (``num_patches``, ``grid_size``, flatten, norm), so timm's
``VisionTransformer(embed_layer=ConvStemPatchEmbed)`` uses it unchanged. On 28-32 px images it makes
a ViT train in a few epochs. The default adds a few million FLOPs per image (patch 4, embed 128); each
stride-1 convolution of ``c`` channels adds ``18 c^2`` per token.

The convolutions run channels-last (NHWC), the layout oneDNN's and cuDNN's kernels work in: the input is laid
out so before the first one, and each weight for its call (a differentiable copy of at most a few hundred KB; the
parameters stay contiguous, as FSDP2 and safetensors need). On a 2-core AMD EPYC (float32) the main job's stem took
0.86-0.88x the time of the default NCHW layout, forward + backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed
from torch import Tensor, nn

from moekit.moe import kernel_choices

__all__ = ["ConvStemPatchEmbed", "MatmulPatchEmbed", "PatchProjection"]


class PatchProjection(nn.Conv2d):
    """A convolution whose kernel is its stride (a ViT's patchify), computed as one matmul over the patches where
    ``kernel_choices.PATCHIFY_KERNELS`` says so.

    ``PatchProjection.of(conv)`` takes ``conv``'s own parameters. Input ``[B, C, H, W]`` -> ``[B, E, H/p, W/p]``
    as the convolution gives it (rows and columns past the last whole patch left out); the matmul's is laid out
    channels-last, so that ``PatchEmbed``'s flatten to ``[B, tokens, E]`` is a view.
    """

    @classmethod
    def of(cls, conv: nn.Conv2d) -> PatchProjection:
        if (
            conv.kernel_size != conv.stride
            or conv.padding not in ((0, 0), "valid")
            or conv.dilation != (1, 1)
            or conv.groups != 1
        ):
            raise ValueError(
                f"PatchProjection computes a convolution whose kernel is its stride (no padding, dilation or groups); "
                f"got {conv}"
            )
        # Built on the meta device (no draws from the random generator), then given conv's parameters.
        proj = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, bias=False, device="meta")
        proj.weight, proj.bias = conv.weight, conv.bias
        return proj.train(conv.training)

    def forward(self, x_BCHW: Tensor) -> Tensor:
        if kernel_choices.PATCHIFY_KERNELS.get(x_BCHW.device.type, "conv") == "conv":
            return super().forward(x_BCHW)
        return self._matmul_forward(x_BCHW)

    def _matmul_forward(self, x_BCHW: Tensor) -> Tensor:
        (ph, pw), (B, C, H, W) = self.kernel_size, x_BCHW.shape
        gh, gw = H // ph, W // pw
        x_BCHW = x_BCHW[:, :, : gh * ph, : gw * pw]
        # each patch's pixels in the weight's (C, ph, pw) order
        patches = x_BCHW.reshape(B, C, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(B, gh, gw, C * ph * pw)
        y = F.linear(patches, self.weight.flatten(1), self.bias)  # [B, gh, gw, E]
        return y.permute(0, 3, 1, 2)  # [B, E, gh, gw]


class MatmulPatchEmbed(PatchEmbed):
    """timm's ``PatchEmbed`` with its projection computed by :class:`PatchProjection` (same signature)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.proj = PatchProjection.of(self.proj)

    def set_input_size(self, img_size=None, patch_size=None):
        super().set_input_size(img_size, patch_size)
        if not isinstance(self.proj, PatchProjection):  # timm resampled the weight into a new nn.Conv2d
            self.proj = PatchProjection.of(self.proj)


class _ChannelsLastConv2d(nn.Conv2d):
    """``nn.Conv2d`` on a channels-last input with its weight laid out channels-last for the call."""

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.weight.contiguous(memory_format=torch.channels_last), self.bias)


class ConvStemPatchEmbed(PatchEmbed):
    """Patch embedding by stacked 3x3 convolutions; ``patch_size`` must be a power of 2.

    ``channels``: the output channels of each 3x3 convolution; the first ``log2(patch_size)`` have stride 2,
    any further ones stride 1 (at the token grid). Default: one per stride-2 stage, doubling up to
    ``embed_dim // 2`` (patch 4, embed 128: ``in -> 32 -> 64 -> (1x1) 128``).
    Input ``[B, C, H, W]`` -> tokens ``[B, (H/p) * (W/p), embed_dim]``.
    """

    def __init__(
        self,
        img_size=224,
        patch_size=16,
        in_chans=3,
        embed_dim=768,
        norm_layer=None,
        bias=True,
        channels: Sequence[int] | None = None,
        **kwargs,
    ):
        super().__init__(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            norm_layer=norm_layer,
            bias=bias,
            **kwargs,
        )
        stride_h, stride_w = self.patch_size
        stages = int(math.log2(stride_h)) if stride_h == stride_w else -1
        if stages < 1 or 2**stages != stride_h:
            raise ValueError(
                f"stem='conv' needs a square power-of-2 patch_size (2, 4, 8, 16); got patch_size={self.patch_size}"
            )
        if channels is None:
            channels = [max(8, embed_dim // 2 ** (stages - stage)) for stage in range(stages)]
        channels = [int(c) for c in channels]
        if len(channels) < stages or min(channels) < 1:
            raise ValueError(
                f"stem channels={channels}: patch_size {stride_h} needs at least {stages} positive entries "
                f"(one per stride-2 convolution; extra entries add stride-1 convolutions)"
            )
        layers: list[nn.Module] = []
        width = in_chans
        for index, out in enumerate(channels):
            layers += [
                _ChannelsLastConv2d(width, out, 3, stride=2 if index < stages else 1, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            width = out
        layers.append(_ChannelsLastConv2d(width, embed_dim, 1, bias=bias))
        self.proj = nn.Sequential(*layers)

    def forward(self, x: Tensor):
        # [B, C, H, W] laid out channels-last; the output's flatten to [B, tokens, embed_dim] is then a view.
        return super().forward(x.contiguous(memory_format=torch.channels_last))
