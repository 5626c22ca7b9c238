"""Seeded inputs for the DiTs of the tiny folders, group by group, as diffusers takes them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from components.models.dit.flux import FluxInputs
from components.models.dit.pixart import PixArtInputs
from components.models.dit.qwen_image import QwenImageInputs
from components.models.dit.sd3 import Sd3Inputs
from components.models.dit.wan import WanInputs
from components.models.dit.z_image import ZImageInputs
from components.recipes.flux import FluxRecipe
from components.recipes.pixart import PixArtSigmaRecipe
from components.recipes.qwen_image import MAX_TOKENS as QWEN_MAX_TOKENS
from components.recipes.sd3 import Sd3Recipe
from components.recipes.wan import WanRecipe

KINDS = {
    "pixart": "pixart_transformer",
    "flux": "flux_transformer",
    "sd3": "sd3_transformer",
    "qwen-image": "qwen_image_transformer",
    "z-image": "z_image_transformer",
    "wan": "wan_transformer",
}
"""Each family's DiT kind."""


class Request(NamedTuple):
    """One request: its latent grid (h, w), its prompt's real tokens and its latent frames
    (a video DiT's; the image DiTs make one)."""

    grid: tuple[int, int]
    text: int
    frames: int = 1


MIXED = (Request((8, 8), 3), Request((12, 6), 7, 2), Request((6, 10), 5, 3))
"""Three requests of three sizes, three prompt lengths and three frame counts."""

CLIP_TOKENS = 77
"""The CLIP tokens SD3 puts before T5's in its joint text."""
MAX_TEXT = {
    "pixart": PixArtSigmaRecipe.max_tokens,
    "flux": FluxRecipe.max_tokens,
    "sd3": CLIP_TOKENS + Sd3Recipe.max_tokens,
    "qwen-image": QWEN_MAX_TOKENS,
    "wan": WanRecipe.max_tokens,
}
"""The most text tokens each family's pipeline gives its DiT."""
SWEEP_GRIDS = ((2, 2), (4, 6), (10, 8))
"""Latent grids of 1, 6 and 20 image tokens (each family makes a token of 2 x 2 latents)."""


def group_of(family: str, config: Mapping[str, Any], requests: Sequence[Request], seed: int) -> Any:
    """Return one group of same-sized ``requests`` (their text may differ in length)."""
    generator = torch.Generator().manual_seed(seed)
    (h, w), count = requests[0].grid, len(requests)
    longest = max(r.text for r in requests)
    t = torch.rand(count, generator=generator)
    if family == "wan":
        return WanInputs(
            hidden_states=torch.randn(
                count, int(config["in_channels"]), requests[0].frames, h, w, generator=generator
            ),
            timestep=t * 1000,
            encoder_hidden_states=torch.randn(
                count, longest, int(config["text_dim"]), generator=generator
            ),
        )
    if family == "pixart":
        mask = torch.zeros(count, longest + 2, dtype=torch.int64)  # padded past the longest
        for row, request in enumerate(requests):
            mask[row, : request.text] = 1
        return PixArtInputs(
            hidden_states=torch.randn(count, int(config["in_channels"]), h, w, generator=generator),
            encoder_hidden_states=torch.randn(
                count, longest + 2, int(config["caption_channels"]), generator=generator
            ),
            timestep=t * 1000,
            encoder_attention_mask=mask,
        )
    if family == "flux":
        rows, columns = h // 2, w // 2
        ids = torch.zeros(rows * columns, 3)
        ids[:, 1] = torch.arange(rows * columns) // columns
        ids[:, 2] = torch.arange(rows * columns) % columns
        return FluxInputs(
            hidden_states=torch.randn(
                count, rows * columns, int(config["in_channels"]), generator=generator
            ),
            encoder_hidden_states=torch.randn(
                count, longest, int(config["joint_attention_dim"]), generator=generator
            ),
            pooled_projections=torch.randn(
                count, int(config["pooled_projection_dim"]), generator=generator
            ),
            timestep=t,
            img_ids=ids,
            txt_ids=torch.zeros(longest, 3),
            guidance=torch.full((count,), 3.5) if config.get("guidance_embeds") else None,
        )
    if family == "qwen-image":
        rows, columns = h // 2, w // 2
        mask = torch.zeros(count, longest, dtype=torch.int64)
        for row, request in enumerate(requests):
            mask[row, : request.text] = 1
        return QwenImageInputs(
            hidden_states=torch.randn(
                count, rows * columns, int(config["in_channels"]), generator=generator
            ),
            encoder_hidden_states=torch.randn(
                count, longest, int(config["joint_attention_dim"]), generator=generator
            ),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            timestep=t,
            img_shapes=[[(1, rows, columns)]] * count,
        )
    if family == "z-image":
        channels, width = int(config["in_channels"]), int(config["cap_feat_dim"])
        return ZImageInputs(
            x=list(torch.randn(count, channels, 1, h, w, generator=generator)),
            t=t,
            cap_feats=[torch.randn(r.text, width, generator=generator) for r in requests],
        )
    return Sd3Inputs(
        hidden_states=torch.randn(count, int(config["in_channels"]), h, w, generator=generator),
        encoder_hidden_states=torch.randn(
            count, longest, int(config["joint_attention_dim"]), generator=generator
        ),
        pooled_projections=torch.randn(
            count, int(config["pooled_projection_dim"]), generator=generator
        ),
        timestep=t * 1000,
    )


def mixed_groups(family: str, config: Mapping[str, Any], seed: int = 0) -> list[Any]:
    """Return ``MIXED`` as three groups of one request each, plus a group of two."""
    groups = [group_of(family, config, [r], seed + i) for i, r in enumerate(MIXED)]
    return [*groups, group_of(family, config, [MIXED[0], MIXED[0]._replace(text=2)], seed + 9)]


def sweep_forwards(family: str, config: Mapping[str, Any]) -> list[list[Any]]:
    """Return forwards (each a list of groups) that put a shard boundary at every kind of place.

    Each grid of ``N`` image tokens runs alone with every prompt length from 1 to ``N + 3``
    tokens (under two shards the boundary falls in the image, between text and image,
    then in the text: a shard of no text rows, then one of no image rows) and with the
    family's longest text; the largest grid only at the lengths that move the boundary
    across. Then requests of one token each and of many, packed so that one lies
    wholly in a shard.
    """
    longest = MAX_TEXT[family]
    forwards = []
    for grid in SWEEP_GRIDS:
        tokens = grid[0] * grid[1] // 4
        lengths = range(1, tokens + 4) if tokens < 10 else (1, tokens, tokens + 1, tokens + 2)
        for text in (*lengths, longest):
            forwards.append([Request(grid, text)])
    small, large = Request((2, 2), 1), Request((10, 8), 7)
    for requests in ((small, small), (small, large), (large, small), (small, large, small)):
        forwards.append(list(requests))
    return [
        [group_of(family, config, [r], seed) for r in requests]
        for seed, requests in enumerate(forwards)
    ]
