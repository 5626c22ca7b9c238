"""The pieces the DiTs share, named as diffusers names them so its files load as they are.

Each module holds exactly the tensors of its diffusers twin under the same names
(``timestep_embedder.linear_1``, ``ff.net.0.proj``, ``norm1.linear``); the arithmetic
follows diffusers' order where rounding would otherwise differ.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.functional import gelu, silu

__all__ = [
    "FeedForward",
    "Modulation",
    "TextProjection",
    "TimestepEmbedding",
    "gelu_",
    "timestep_features",
]

# B requests, E width, n rows

TIMESTEP_CHANNELS = 256
"""The sinusoidal width of a timestep (or guidance) before its embedder."""
MAX_PERIOD = 10_000


def timestep_features(
    timesteps: torch.Tensor, channels: int = TIMESTEP_CHANNELS, scale: float = 1.0
) -> torch.Tensor:
    """Embed ``timesteps`` ``(B,)`` as ``(B, channels)`` float32 cosines then sines.

    diffusers' ``Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=0, scale)``:
    the angles are scaled after the product, as there.
    """
    half = channels // 2
    exponent = -math.log(MAX_PERIOD) * torch.arange(
        half, dtype=torch.float32, device=timesteps.device
    )
    angles = timesteps[:, None].float() * torch.exp(exponent / half)[None, :]  # (B, half)
    if scale != 1:
        angles = scale * angles
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    """Map sinusoidal features to the model width: ``linear_1``, SiLU, ``linear_2``."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Embed ``(B, channels)`` into ``(B, E)``."""
        out: torch.Tensor = self.linear_2(silu(self.linear_1(features)))
        return out


class TextProjection(nn.Module):
    """Project text features: ``linear_1``, an activation, ``linear_2`` (PixArt's captions,
    the pooled vectors of Flux and SD3).

    Args:
        width: the input width.
        dim: the output width.
        tanh_gelu: GELU (tanh) between the two; SiLU otherwise.
    """

    def __init__(self, width: int, dim: int, *, tanh_gelu: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(width, dim)
        self.linear_2 = nn.Linear(dim, dim)
        self.tanh_gelu = tanh_gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``(..., width)`` to ``(..., E)``."""
        h = self.linear_1(x)
        h = gelu(h, approximate="tanh") if self.tanh_gelu else silu(h)
        out: torch.Tensor = self.linear_2(h)
        return out


class Modulation(nn.Module):
    """The ``linear`` of an adaptive norm: ``chunks`` per-request vectors from the conditioning.

    diffusers' ``AdaLayerNormZero`` (6 chunks), ``AdaLayerNormZeroSingle`` (3) and
    ``AdaLayerNormContinuous`` (2) hold only this linear; the norm itself has no weights.
    """

    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, chunks * dim)
        self.chunks = chunks

    def forward(self, condition: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Return ``chunks`` tensors ``(B, E)`` from ``condition`` ``(B, E)``."""
        return self.linear(silu(condition)).chunk(self.chunks, dim=1)  # type: ignore[no-any-return]


class GeluProjection(nn.Module):
    """The first layer of a feed-forward: ``proj`` then GELU (tanh, or exact with ``exact``)."""

    def __init__(self, dim: int, inner: int, *, exact: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)
        self.exact = exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``(n, E)`` to ``(n, inner)`` and apply GELU."""
        if self.exact:
            out: torch.Tensor = torch.ops.aten.gelu_(self.proj(x))
            return out
        return gelu_(self.proj(x))


def gelu_(x: torch.Tensor) -> torch.Tensor:
    """Apply GELU (tanh) to ``x`` in place: the widest activation of a block, never copied."""
    out: torch.Tensor = torch.ops.aten.gelu_(x, approximate="tanh")
    return out


class FeedForward(nn.Module):
    """diffusers' ``FeedForward``: ``net.0.proj``, GELU, ``net.2``.

    ``net.1`` (dropout in diffusers) holds nothing and does nothing at inference.

    Args:
        dim: the input width E.
        mult: the hidden width as a multiple of E, unless ``inner`` gives it.
        inner: the hidden width (Wan's ``ffn_dim``).
        out: the output width; None is E.
        exact: exact GELU (``gelu``) rather than its tanh approximation (``gelu-approximate``).
    """

    def __init__(
        self,
        dim: int,
        mult: int = 4,
        *,
        inner: int | None = None,
        out: int | None = None,
        exact: bool = False,
    ) -> None:
        super().__init__()
        hidden = inner or dim * mult
        self.net = nn.ModuleList(
            [GeluProjection(dim, hidden, exact=exact), nn.Identity(), nn.Linear(hidden, out or dim)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(n, E)`` to ``(n, out)``."""
        first, _, last = self.net
        out: torch.Tensor = last(first(x))
        return out
