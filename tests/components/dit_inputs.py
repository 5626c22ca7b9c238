"""Seeded inputs for the DiTs of the tiny folders, group by group, as diffusers takes them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from components.kinds.dit.flux import FluxInputs
from components.kinds.dit.pixart import PixArtInputs
from components.kinds.dit.sd3 import Sd3Inputs

KINDS = {"pixart": "pixart_transformer", "flux": "flux_transformer", "sd3": "sd3_transformer"}
"""Each family's DiT kind."""


class Request(NamedTuple):
    """One request: its latent grid (h, w) and its prompt's real tokens."""

    grid: tuple[int, int]
    text: int


MIXED = (Request((8, 8), 3), Request((12, 6), 7), Request((6, 10), 5))
"""Three requests of three sizes and three prompt lengths."""


def group_of(family: str, config: Mapping[str, Any], requests: Sequence[Request], seed: int) -> Any:
    """Return one group of same-sized ``requests`` (their text may differ in length)."""
    generator = torch.Generator().manual_seed(seed)
    (h, w), count = requests[0].grid, len(requests)
    longest = max(r.text for r in requests)
    t = torch.rand(count, generator=generator)
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
