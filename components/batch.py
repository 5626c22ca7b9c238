"""What one request carries from stage to stage while a pipeline runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec
import torch
from torch import nn

# B prompts, N latent tokens, C latent channels, L text tokens, E text embedding width


RGB = 3  # the colour channels of Batch.images
BatchField = Literal["prompts", "context", "pooled", "sentence_embeddings", "latents", "images"]


class Port(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``Batch`` field a kind reads or writes, with the width its options imply.

    Admission walks the stages with these, so components that do not fit
    together are refused before anything is built.

    Attributes:
        field: the ``Batch`` attribute.
        width: the size of its last dimension (E, C, 3 colour channels); None when it
            has none (text).
        option: the kind's option that sets the width, named in the refusal's hint.
    """

    field: BatchField
    width: int | None = None
    option: str | None = None


def device_of(module: nn.Module) -> torch.device:
    """Return the device ``module``'s weights are on (inputs made on the host go there)."""
    return next(module.parameters()).device


@dataclass
class Batch:
    """The values a request hands from one component to the next.

    Each kind's ``run`` reads what it needs (making seeded inputs when an
    earlier stage did not provide them) and writes what it produces.

    Attributes:
        generator: the seeded source of every input a kind makes up.
        steps: denoising steps for a denoiser.
        size: prompts in the request.
        latent_size: the latent grid (h, w); the image is larger per the decoder.
        prompts: the request's text, ``size`` sentences; a text encoder picks seeded
            ones (and records them here) when none are given.
        context: text embeddings, one ``(L_i, E)`` tensor per prompt.
        sentence_embeddings: ``(B, E)``, one unit-length row per prompt (for
            similarity search).
        latents: latents, one ``(N, C)`` tensor per prompt, row-major over (h, w).
        guidance_scale: classifier-free guidance: a denoiser predicts
            ``uncond + scale * (cond - uncond)``; 1 turns it off (one branch); None
            takes the denoiser's own default (its ``guidance_scale`` option).
        negative_prompts: the unconditional branch's text, one sentence per prompt; a
            text encoder embeds them into ``negative_context``.
        negative_context: the unconditional branch's text embeddings, one ``(L_i, E)``
            tensor per prompt (embedded negative prompts); None means the empty prompt,
            one zero embedding.
        images: images ``(B, 3, H, W)`` in [-1, 1]; one ``(3, H_i, W_i)`` tensor per image
            when the batch mixes sizes (``image_sizes``).
        image_size: the images' (height, width) in pixels, for a pipeline from a folder;
            None takes the pipeline's default (a kind's images follow ``latent_size``).
        image_sizes: each image's own (height, width) in pixels, for a folder pipeline
            whose requests of different sizes share the batch; None: all take
            ``image_size``.
        context_mask: which tokens of ``context`` are real, ``(B, L)``, where the
            denoiser masks padding (PixArt); None when it attends to every token.
        negative_context_mask: the same for ``negative_context``.
        pooled: one pooled text vector per prompt, ``(B, P)`` (Flux, SD3).
        negative_pooled: the same for the negative prompts.
    """

    generator: torch.Generator
    steps: int = 4
    size: int = 1
    latent_size: tuple[int, int] = (4, 4)
    prompts: list[str] | None = None
    context: list[torch.Tensor] | None = None
    sentence_embeddings: torch.Tensor | None = None
    latents: list[torch.Tensor] | None = None
    images: torch.Tensor | list[torch.Tensor] | None = field(default=None)
    guidance_scale: float | None = None
    negative_prompts: list[str] | None = None
    negative_context: list[torch.Tensor] | None = None
    image_size: tuple[int, int] | None = None
    image_sizes: list[tuple[int, int]] | None = None
    context_mask: torch.Tensor | None = None
    negative_context_mask: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None
