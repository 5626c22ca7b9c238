"""``tiny_vae``: a VAE decoder, latents ``(B, C_lat, h, w)`` to images ``(B, 3, 4h, 4w)``.

Conv in, a residual block, one self-attention over the ``h * w`` latent positions
(site ``mid``), a residual block, two 2x upsamplings, conv out, tanh. Custom path only.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

import msgspec
import torch
from torch import nn
from torch.nn.functional import interpolate, silu

from attention import AttentionRole
from components.batch import RGB, Batch, Port, device_of
from components.kinds import tensors
from components.loader import ComponentLoader, SeededOptions
from components.sites import AttentionSite
from components.weights import DeclaredTensors

__all__ = ["TinyVaeLoader"]

# B batch, H heads, S seq (h * w positions), D head dim, Ch channels


class TinyVaeOptions(SeededOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``tiny_vae``.

    Attributes:
        latent_channels: channels of the latents (the DiT's ``in_channels``).
        channels: the decoder's width; a multiple of ``groups`` and of ``heads``.
        groups: GroupNorm groups.
        heads: heads of the mid-block attention.

    Raises:
        ValueError: ``groups`` or ``heads`` does not divide ``channels`` (a
            ``msgspec.ValidationError`` when the options are decoded).
    """

    latent_channels: Annotated[int, msgspec.Meta(ge=1)] = 4
    channels: Annotated[int, msgspec.Meta(ge=1)] = 32
    groups: Annotated[int, msgspec.Meta(ge=1)] = 8
    heads: Annotated[int, msgspec.Meta(ge=1)] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value in (("groups", self.groups), ("heads", self.heads)):
            if self.channels % value:
                raise ValueError(
                    f"{name} = {value} must divide channels = {self.channels}; change one of them"
                )


class VaeInputs(NamedTuple):
    """The arguments of ``TinyVae.forward``."""

    latents: torch.Tensor  # (B, C_lat, h, w)


class ResidualBlock(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, twice, plus the input.

    Args:
        channels: width in and out.
        groups: GroupNorm groups.
    """

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` ``(B, Ch, h, w)`` plus its residual."""
        h = self.conv1(silu(self.norm1(x)))
        out: torch.Tensor = x + self.conv2(silu(self.norm2(h)))
        return out


class MidAttention(nn.Module):
    """Self-attention over all spatial positions of a feature map.

    Args:
        channels: width in and out.
        groups: GroupNorm groups.
        site: the declared ``mid`` site; its heads and layer come from it.
    """

    def __init__(self, channels: int, groups: int, site: AttentionSite) -> None:
        super().__init__()
        self.heads = site.heads
        self.norm = nn.GroupNorm(groups, channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.Linear(channels, channels)
        self.attn = site.build_layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` ``(B, Ch, h, w)`` plus attention over its ``h * w`` positions."""
        b, ch, hh, ww = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (B, S, Ch)
        q, k, v = (
            proj(tokens).reshape(b, hh * ww, self.heads, ch // self.heads).transpose(1, 2)
            for proj in (self.to_q, self.to_k, self.to_v)
        )  # (B, H, S, D)
        o = self.attn(q, k, v).transpose(1, 2).flatten(2)  # (B, S, Ch)
        out: torch.Tensor = self.to_out(o).transpose(1, 2).reshape(b, ch, hh, ww)
        return x + out


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling, then a 3x3 conv.

    Args:
        channels: width in and out.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, Ch, h, w)`` to ``(B, Ch, 2h, 2w)``."""
        out: torch.Tensor = self.conv(interpolate(x, scale_factor=2.0, mode="nearest"))
        return out


class TinyVae(nn.Module):
    """Decode latents into images in [-1, 1].

    Args:
        options: the kind's options.
        site: the declared ``mid`` site.
    """

    def __init__(self, options: TinyVaeOptions, site: AttentionSite) -> None:
        super().__init__()
        ch, groups = options.channels, options.groups
        self.conv_in = nn.Conv2d(options.latent_channels, ch, 3, padding=1)
        self.res1 = ResidualBlock(ch, groups)
        self.mid = MidAttention(ch, groups, site)
        self.res2 = ResidualBlock(ch, groups)
        self.up = nn.Sequential(Upsample(ch), Upsample(ch))
        self.norm_out = nn.GroupNorm(groups, ch)
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode ``latents`` ``(B, C_lat, h, w)`` into images ``(B, 3, 4h, 4w)`` in [-1, 1]."""
        x = self.res2(self.mid(self.res1(self.conv_in(latents))))  # (B, Ch, h, w)
        x = self.up(x)  # (B, Ch, 4h, 4w)
        return torch.tanh(self.conv_out(silu(self.norm_out(x))))  # (B, 3, 4h, 4w)


class TinyVaeLoader(ComponentLoader):
    """Build ``tiny_vae``; an auxiliary component, so global fallback is allowed."""

    kind: ClassVar[str] = "tiny_vae"
    fully_shardable = True
    options_type = TinyVaeOptions
    allows_global_fallback = True

    def __init__(self, options: TinyVaeOptions) -> None:
        super().__init__(options)
        self.options: TinyVaeOptions = options

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare the mid-block self-attention: dense kernels only, torch_sdpa by default."""
        return (
            AttentionSite(
                name="mid",
                role=AttentionRole.SELF,
                heads=self.options.heads,
                supported=frozenset({"torch_sdpa", "torch_flash"}),
                default="torch_sdpa",
            ),
        )

    def tensors(self) -> DeclaredTensors:
        """Declare the stem, two residual blocks, the mid attention, upsampling and head."""
        o = self.options
        ch = o.channels
        declared = {
            **tensors.conv3x3("conv_in", o.latent_channels, ch),
            **tensors.norm("mid.norm", ch),
            **{
                k: v
                for q in ("q", "k", "v", "out")
                for k, v in tensors.linear(f"mid.to_{q}", ch, ch).items()
            },
            **tensors.conv3x3("up.0.conv", ch, ch),
            **tensors.conv3x3("up.1.conv", ch, ch),
            **tensors.norm("norm_out", ch),
            **tensors.conv3x3("conv_out", ch, 3),
        }
        for block in ("res1", "res2"):
            declared |= {
                **tensors.norm(f"{block}.norm1", ch),
                **tensors.conv3x3(f"{block}.conv1", ch, ch),
                **tensors.norm(f"{block}.norm2", ch),
                **tensors.conv3x3(f"{block}.conv2", ch, ch),
            }
        return declared

    def reads(self) -> tuple[Port, ...]:
        """Read latents of ``latent_channels``."""
        return (
            Port(field="latents", width=self.options.latent_channels, option="latent_channels"),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write RGB images."""
        return (Port(field="images", width=RGB),)

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Decode the request's latents (seeded noise if none) into images."""
        h, w = batch.latent_size
        channels = self.options.latent_channels
        tokens = batch.latents or [
            torch.randn(h * w, channels, generator=batch.generator) for _ in range(batch.size)
        ]  # (N, C) each, row-major over (h, w)
        latents = torch.stack([x.T.reshape(channels, h, w) for x in tokens])  # (B, C, h, w)
        batch.images = module(latents.to(device_of(module)))

    def build_custom(self) -> TinyVae:
        """Build the decoder with one ``attention.Attention`` layer of site ``mid``."""
        (site,) = self.sites()
        return TinyVae(self.options, site)


def example_inputs(
    options: TinyVaeOptions, batch: int, generator: torch.Generator, size: int = 4
) -> VaeInputs:
    """Make ``batch`` seeded standard-normal latents of ``size x size`` positions."""
    return VaeInputs(torch.randn(batch, options.latent_channels, size, size, generator=generator))
