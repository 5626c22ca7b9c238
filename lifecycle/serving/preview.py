"""Cheap previews of an image while it is denoised (``stream: true``, design §15).

A preview is not decoded by the pipeline's decoder (a whole VAE pass per preview
would cost as much as the image itself). It is a *linear latent-to-RGB map*: each
latent token's ``C`` channels times a ``(C + 1) x 3`` matrix (the last row a bias)
give that token's colour, and each token becomes a ``scale x scale`` block of the
image (nearest upsampling), the way latent previews of diffusion UIs work.

The map is fitted once, by least squares, at warm-up: on the warm-up request's
final latents against the mean colour of the pixels each token decoded to. So it
follows whatever decoder the pipeline has, roughly: a preview shows the layout and
the colours, not the detail. ``python -m benchmarks serving`` measures its cost
per step.
"""

from __future__ import annotations

import torch

from lifecycle.pictures.png import encode_png

__all__ = ["PreviewMap", "fit_preview", "preview_png"]

# N latent tokens, C latent channels, h, w latent grid, s pixels per token side

PreviewMap = tuple[tuple[float, float, float], ...]
"""``C + 1`` rows of 3: one per latent channel, then the bias."""


def fit_preview(
    latents: torch.Tensor, image: torch.Tensor, latent_size: tuple[int, int], scale: int
) -> PreviewMap:
    """Fit the linear map from ``latents`` ``(N, C)`` to the colours of ``image`` ``(3, H, W)``.

    Non-finite latents or colours give the zero map (grey previews).
    """
    h, w = latent_size
    colours = image.float().reshape(3, h, scale, w, scale).mean(dim=(2, 4))  # (3, h, w)
    targets = colours.reshape(3, h * w).T  # (N, 3)
    inputs = torch.cat([latents.float(), torch.ones(h * w, 1)], dim=1)  # (N, C + 1)
    if not (inputs.isfinite().all() and targets.isfinite().all()):
        # nothing to fit (lstsq fails on them): grey previews; such images are refused
        return tuple((0.0, 0.0, 0.0) for _ in range(inputs.shape[1]))
    solution = torch.linalg.lstsq(inputs, targets).solution  # (C + 1, 3)
    return tuple((float(r), float(g), float(b)) for r, g, b in solution.tolist())


def preview_image(
    latents: torch.Tensor, mapping: PreviewMap, latent_size: tuple[int, int], scale: int
) -> torch.Tensor:
    """Return the preview of ``latents`` ``(N, C)``: an image ``(3, h * s, w * s)`` in [-1, 1]."""
    h, w = latent_size
    weights = torch.tensor(mapping)  # (C + 1, 3)
    colours = latents.float().cpu() @ weights[:-1] + weights[-1]  # (N, 3)
    grid = colours.T.reshape(3, h, w).clamp(-1, 1)
    return grid.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)


def preview_png(
    latents: torch.Tensor, mapping: PreviewMap, latent_size: tuple[int, int], scale: int
) -> bytes:
    """Return the preview of ``latents`` ``(N, C)`` as PNG bytes."""
    return encode_png(preview_image(latents, mapping, latent_size, scale))
