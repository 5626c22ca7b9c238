"""``tiny_upsampler``: a 2x super-resolution net of convolutions only (no attention site)."""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

import msgspec
import torch
from torch import nn
from torch.nn.functional import interpolate, silu

from components.batch import RGB, Batch, Port, device_of
from components.kinds import tensors
from components.loader import ComponentLoader, SeededOptions
from components.sites import AttentionSite
from components.weights import DeclaredTensors

__all__ = ["TinyUpsamplerLoader"]

# B batch, Ch channels, H height, W width


class TinyUpsamplerOptions(SeededOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``tiny_upsampler``.

    Attributes:
        channels: the width of the hidden convolutions.
    """

    channels: Annotated[int, msgspec.Meta(ge=1)] = 16


class UpsamplerInputs(NamedTuple):
    """The arguments of ``TinyUpsampler.forward``."""

    images: torch.Tensor  # (B, 3, H, W) in [-1, 1]


class TinyUpsampler(nn.Module):
    """Double an image's resolution: a nearest-neighbour base plus a learned residual.

    Args:
        options: the kind's options.
    """

    def __init__(self, options: TinyUpsamplerOptions) -> None:
        super().__init__()
        ch = options.channels
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.conv_mid = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv_out = nn.Conv2d(ch, 3 * 4, 3, padding=1)  # 4 = 2x2 sub-pixels
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map ``images`` ``(B, 3, H, W)`` to ``(B, 3, 2H, 2W)`` in [-1, 1]."""
        x = silu(self.conv_in(images))  # (B, Ch, H, W)
        x = silu(self.conv_mid(x))
        residual: torch.Tensor = self.shuffle(self.conv_out(x))  # (B, 3, 2H, 2W)
        # the residual only adds detail: the coarse image comes through unlearned
        base = interpolate(images, scale_factor=2.0, mode="nearest")  # (B, 3, 2H, 2W)
        return (base + residual).clamp(-1.0, 1.0)


class TinyUpsamplerLoader(ComponentLoader):
    """Build ``tiny_upsampler``; it builds no attention layer, so it declares no site."""

    kind: ClassVar[str] = "tiny_upsampler"
    fully_shardable = True
    options_type = TinyUpsamplerOptions

    def __init__(self, options: TinyUpsamplerOptions) -> None:
        super().__init__(options)
        self.options: TinyUpsamplerOptions = options

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare no attention site: the network is convolutions only."""
        return ()

    def tensors(self) -> DeclaredTensors:
        """Declare the three convolutions."""
        ch = self.options.channels
        return {
            **tensors.conv3x3("conv_in", 3, ch),
            **tensors.conv3x3("conv_mid", ch, ch),
            **tensors.conv3x3("conv_out", ch, 3 * 4),
        }

    def reads(self) -> tuple[Port, ...]:
        """Read RGB images."""
        return (Port(field="images", width=RGB),)

    def writes(self) -> tuple[Port, ...]:
        """Write RGB images, twice as large."""
        return (Port(field="images", width=RGB),)

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Upsample the request's images (seeded ones if none) by two; each alone when their
        sizes differ."""
        images = batch.images
        device = device_of(module)
        if isinstance(images, list):
            batch.images = [module(image[None].to(device))[0] for image in images]
            return
        if images is None:
            images = torch.rand(batch.size, 3, 16, 16, generator=batch.generator) * 2 - 1
        batch.images = module(images.to(device))

    def build_custom(self) -> TinyUpsampler:
        """Build the convolutional upsampler."""
        return TinyUpsampler(self.options)


def example_inputs(
    options: TinyUpsamplerOptions, batch: int, generator: torch.Generator, size: int = 8
) -> UpsamplerInputs:
    """Make ``batch`` seeded images of ``size x size`` pixels, uniform in [-1, 1]."""
    return UpsamplerInputs(torch.rand(batch, 3, size, size, generator=generator) * 2 - 1)
