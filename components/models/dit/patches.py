"""Latents to patch tokens with sine-cosine positions, and tokens back to latents (PixArt, SD3).

Positions are computed for each request's own grid, so requests of different sizes
carry their own. PixArt keeps the table of its training grid (diffusers computes it at
construction and does not store it) and computes any other grid afresh; SD3 stores a
table of its largest grid and crops each request's grid from its centre.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["PatchEmbed", "unpatchify"]

# B images, C channels, E width, h w latent grid, p patch side, N tokens (h/p * w/p)

POSITION_BASE = 10_000.0


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Embed ``positions`` ``(M,)`` as ``(M, dim)`` sines then cosines, computed in float64."""
    omega = torch.arange(dim // 2, dtype=torch.float64, device=positions.device) / (dim / 2.0)
    angles = torch.outer(positions.reshape(-1), 1.0 / POSITION_BASE**omega)  # (M, dim/2)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def sincos_2d(
    dim: int, grid: tuple[int, int], base: int, interpolation: float, device: torch.device
) -> torch.Tensor:
    """Embed every cell of a ``grid`` (rows, columns) as ``(rows * columns, dim)`` float32.

    As diffusers' ``get_2d_sincos_pos_embed``: positions are scaled to a ``base``-wide
    grid and divided by ``interpolation``; the first half of the width embeds the
    column, the second the row; cells are in row-major order.
    """
    rows, columns = grid
    row = torch.arange(rows, dtype=torch.float32, device=device) / (rows / base) / interpolation
    column = (
        torch.arange(columns, dtype=torch.float32, device=device) / (columns / base) / interpolation
    )
    column_of_cell = column[None, :].expand(rows, columns).reshape(-1)
    row_of_cell = row[:, None].expand(rows, columns).reshape(-1)
    cells = [sincos_1d(dim // 2, column_of_cell), sincos_1d(dim // 2, row_of_cell)]
    return torch.cat(cells, dim=1).float()


class PatchEmbed(nn.Module):
    """diffusers' ``PatchEmbed``: a strided ``proj`` convolution, then positions added.

    Args:
        channels: the latent channels C.
        dim: the width E.
        patch: the patch side p.
        grid: the side of the stored (SD3, ``stored``) or training (PixArt) table, in patches.
        interpolation: how positions are scaled (PixArt).
        stored: the table is in the weights files, and grids are cropped from its centre
            (SD3); otherwise it is computed here and other grids computed afresh (PixArt).
    """

    def __init__(
        self,
        channels: int,
        dim: int,
        patch: int,
        grid: int,
        *,
        interpolation: float = 1.0,
        stored: bool,
    ) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.patch = patch
        self.grid = grid
        self.interpolation = interpolation
        self.stored = stored
        # a stored table comes from the files; a computed one is the training grid's
        table = (
            torch.empty(grid * grid, dim)
            if stored
            else sincos_2d(dim, (grid, grid), grid, interpolation, torch.device("cpu"))
        )
        self.register_buffer("pos_embed", table[None], persistent=stored)  # (1, grid^2, E)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Embed ``(B, C, h, w)`` latents as ``(B, N, E)`` tokens with their positions."""
        rows, columns = latents.shape[-2] // self.patch, latents.shape[-1] // self.patch
        tokens: torch.Tensor = self.proj(latents).flatten(2).transpose(1, 2)  # (B, N, E)
        return (tokens + self.positions(rows, columns)).to(tokens.dtype)

    def positions(self, rows: int, columns: int) -> torch.Tensor:
        """Return the positions of a ``rows x columns`` grid of patches: ``(1, N, E)``.

        Raises:
            ValueError: a stored table is smaller than the grid (the message names both).
        """
        table = self.pos_embed
        assert isinstance(table, torch.Tensor)  # a buffer
        if self.stored:
            if rows > self.grid or columns > self.grid:
                raise ValueError(
                    f"a {rows}x{columns} grid of patches is larger than the DiT's position "
                    f"table ({self.grid}x{self.grid}, pos_embed_max_size); ask for a smaller size"
                )
            top, left = (self.grid - rows) // 2, (self.grid - columns) // 2
            square = table.reshape(1, self.grid, self.grid, -1)
            return square[:, top : top + rows, left : left + columns].reshape(1, rows * columns, -1)
        if (rows, columns) == (self.grid, self.grid):
            return table
        dim = table.shape[-1]
        fresh = sincos_2d(dim, (rows, columns), self.grid, self.interpolation, table.device)
        return fresh[None]


def unpatchify(tokens: torch.Tensor, size: Sequence[int], patch: int) -> torch.Tensor:
    """Fold tokens ``(B, N, p * p * C)`` back into latents ``(B, C, h, w)``, ``size`` ``(h, w)``."""
    b, (height, width) = tokens.shape[0], size
    grid = tokens.reshape(b, height // patch, width // patch, patch, patch, -1)
    return torch.einsum("nhwpqc->nchpwq", grid).reshape(b, -1, height, width)
