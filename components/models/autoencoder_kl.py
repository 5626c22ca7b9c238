"""diffusers' ``AutoencoderKL`` (encoder and decoder) on ``attention.Attention``.

Residual blocks of group norm, SiLU and 3x3 convolutions; a mid block with one
single-head self-attention over the latent grid (site ``mid``); strided convolutions
down, nearest-neighbour doubling and a convolution up. Decoding is what a pipeline
uses; the encoder is loaded too, since the folder's file holds both halves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.functional import interpolate, pad, silu

from components.sites import AttentionSite, SiteLayer

__all__ = ["AutoencoderKl", "VaeShape", "unsupported"]

# B images, C channels, H W spatial size, L latent channels, N = H·W positions

DOWN_BLOCK = "DownEncoderBlock2D"
UP_BLOCK = "UpDecoderBlock2D"
EPS = 1e-6  # every group norm of the VAE


class VaeShape(NamedTuple):
    """The sizes of an ``AutoencoderKL``, read from its ``config.json``."""

    in_channels: int
    out_channels: int
    latent_channels: int
    channels: tuple[int, ...]  # block_out_channels, outermost first
    layers: int  # layers_per_block
    groups: int
    attention: bool  # mid_block_add_attention
    quant_conv: bool
    post_quant_conv: bool

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> VaeShape:
        """Read the sizes (``AutoencoderKL``'s keys and defaults)."""
        return cls(
            in_channels=int(config.get("in_channels", 3)),
            out_channels=int(config.get("out_channels", 3)),
            latent_channels=int(config.get("latent_channels", 4)),
            channels=tuple(int(c) for c in config.get("block_out_channels", (64,))),
            layers=int(config.get("layers_per_block", 1)),
            groups=int(config.get("norm_num_groups", 32)),
            attention=bool(config.get("mid_block_add_attention", True)),
            quant_conv=bool(config.get("use_quant_conv", True)),
            post_quant_conv=bool(config.get("use_post_quant_conv", True)),
        )


def unsupported(config: Mapping[str, Any]) -> str | None:
    """Say what of ``config`` this module does not implement, or None."""
    blocks = {
        "down_block_types": (DOWN_BLOCK, config.get("down_block_types", (DOWN_BLOCK,))),
        "up_block_types": (UP_BLOCK, config.get("up_block_types", (UP_BLOCK,))),
    }
    for key, (known, found) in blocks.items():
        other = sorted(set(found) - {known})
        if other:
            return f"its {key} include {', '.join(other)} (the custom path builds {known} only)"
    act = config.get("act_fn", "silu")
    if act != "silu":
        return f"its act_fn is '{act}' (the custom path implements silu)"
    return None


def conv3x3(inputs: int, outputs: int) -> nn.Conv2d:
    """Return a 3x3 convolution that keeps the size."""
    return nn.Conv2d(inputs, outputs, kernel_size=3, padding=1)


class ResnetBlock(nn.Module):
    """Norm, SiLU, conv, twice, plus the input (through a 1x1 conv when widths differ)."""

    def __init__(self, inputs: int, outputs: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, inputs, eps=EPS)
        self.conv1 = conv3x3(inputs, outputs)
        self.norm2 = nn.GroupNorm(groups, outputs, eps=EPS)
        self.conv2 = conv3x3(outputs, outputs)
        self.conv_shortcut = (
            nn.Conv2d(inputs, outputs, kernel_size=1) if inputs != outputs else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, C_in, H, W)`` to ``(B, C_out, H, W)``."""
        h = self.conv1(silu(self.norm1(x)))
        h = self.conv2(silu(self.norm2(h)))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        out: torch.Tensor = skip + h
        return out


class MidAttention(nn.Module):
    """Single-head self-attention over every position of the grid, with a residual.

    Args:
        channels: C, the query, key and value width.
        groups: groups of the input norm.
        site: the declared ``mid`` site.
    """

    def __init__(self, channels: int, groups: int, site: AttentionSite) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])
        self.attn = SiteLayer(site)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the ``H·W`` positions of ``(B, C, H, W)``."""
        b, c, h, w = x.shape
        tokens = self.group_norm(x).view(b, c, h * w).transpose(1, 2)  # (B, N, C)
        q, k, v = (p(tokens)[:, None] for p in (self.to_q, self.to_k, self.to_v))  # (B, 1, N, C)
        o = self.to_out[0](self.attn.layer(q, k, v)[:, 0])  # (B, N, C)
        out: torch.Tensor = o.transpose(1, 2).reshape(b, c, h, w) + x
        return out


class MidBlock(nn.Module):
    """Resnet, attention (on the ``mid`` site, when the config adds it), resnet."""

    def __init__(self, channels: int, groups: int, site: AttentionSite | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups) for _ in range(2)])
        attentions = [] if site is None else [MidAttention(channels, groups, site)]
        self.attentions = nn.ModuleList(attentions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, C, H, W)`` to the same shape."""
        x = self.resnets[0](x)
        for attention in self.attentions:
            x = attention(x)
        out: torch.Tensor = self.resnets[1](x)
        return out


class Downsample(nn.Module):
    """Halve the size: pad right and bottom by one, then a stride-2 3x3 convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, C, H, W)`` to ``(B, C, H/2, W/2)``."""
        out: torch.Tensor = self.conv(pad(x, (0, 1, 0, 1)))
        return out


class Upsample(nn.Module):
    """Double the size by nearest neighbour, then a 3x3 convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = conv3x3(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, C, H, W)`` to ``(B, C, 2H, 2W)``."""
        out: torch.Tensor = self.conv(interpolate(x, scale_factor=2.0, mode="nearest"))
        return out


class DownBlock(nn.Module):
    """Resnets, then a downsample except in the last block."""

    def __init__(self, inputs: int, outputs: int, shape: VaeShape, last: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [
                ResnetBlock(inputs if i == 0 else outputs, outputs, shape.groups)
                for i in range(shape.layers)
            ]
        )
        self.downsamplers = nn.ModuleList([] if last else [Downsample(outputs)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the resnets and the downsample."""
        for module in (*self.resnets, *self.downsamplers):
            x = module(x)
        return x


class UpBlock(nn.Module):
    """One more resnet than the encoder's blocks, then an upsample except in the last block."""

    def __init__(self, inputs: int, outputs: int, shape: VaeShape, last: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [
                ResnetBlock(inputs if i == 0 else outputs, outputs, shape.groups)
                for i in range(shape.layers + 1)
            ]
        )
        self.upsamplers = nn.ModuleList([] if last else [Upsample(outputs)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the resnets and the upsample."""
        for module in (*self.resnets, *self.upsamplers):
            x = module(x)
        return x


class Encoder(nn.Module):
    """Images ``(B, C_in, H, W)`` to the moments ``(B, 2L, h, w)`` of the latent distribution."""

    def __init__(self, shape: VaeShape, site: AttentionSite | None) -> None:
        super().__init__()
        widths = shape.channels
        self.conv_in = conv3x3(shape.in_channels, widths[0])
        self.down_blocks = nn.ModuleList(
            [
                DownBlock(widths[max(i - 1, 0)], width, shape, last=i == len(widths) - 1)
                for i, width in enumerate(widths)
            ]
        )
        self.mid_block = MidBlock(widths[-1], shape.groups, site)
        self.conv_norm_out = nn.GroupNorm(shape.groups, widths[-1], eps=EPS)
        self.conv_out = conv3x3(widths[-1], 2 * shape.latent_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the mean and log-variance, stacked along channels."""
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        out: torch.Tensor = self.conv_out(silu(self.conv_norm_out(x)))
        return out


class Decoder(nn.Module):
    """Latents ``(B, L, h, w)`` to images ``(B, C_out, H, W)``."""

    def __init__(self, shape: VaeShape, site: AttentionSite | None) -> None:
        super().__init__()
        widths = tuple(reversed(shape.channels))
        self.conv_in = conv3x3(shape.latent_channels, widths[0])
        self.mid_block = MidBlock(widths[0], shape.groups, site)
        self.up_blocks = nn.ModuleList(
            [
                UpBlock(widths[max(i - 1, 0)], width, shape, last=i == len(widths) - 1)
                for i, width in enumerate(widths)
            ]
        )
        self.conv_norm_out = nn.GroupNorm(shape.groups, widths[-1], eps=EPS)
        self.conv_out = conv3x3(widths[-1], shape.out_channels)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Return images, about in [-1, 1]."""
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        out: torch.Tensor = self.conv_out(silu(self.conv_norm_out(x)))
        return out


class AutoencoderKl(nn.Module):
    """The VAE: ``encode`` images to latent moments, ``decode`` latents to images.

    Args:
        shape: the VAE's sizes.
        site: the declared ``mid`` site; None when the config adds no attention.
    """

    def __init__(self, shape: VaeShape, site: AttentionSite | None) -> None:
        super().__init__()
        latent = 2 * shape.latent_channels
        self.encoder = Encoder(shape, site)
        self.quant_conv = nn.Conv2d(latent, latent, kernel_size=1) if shape.quant_conv else None
        self.decoder = Decoder(shape, site)
        self.post_quant_conv = (
            nn.Conv2d(shape.latent_channels, shape.latent_channels, kernel_size=1)
            if shape.post_quant_conv
            else None
        )

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Return the moments ``(B, 2L, h, w)`` of images ``(B, C_in, H, W)``: mean, then
        log-variance."""
        moments: torch.Tensor = self.encoder(images)
        return moments if self.quant_conv is None else self.quant_conv(moments)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Return images ``(B, C_out, H, W)`` of latents ``(B, L, h, w)`` (already unscaled)."""
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        images: torch.Tensor = self.decoder(latents)
        return images

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode (what a pipeline runs the VAE for)."""
        return self.decode(latents)
