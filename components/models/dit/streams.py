"""Every request's rows of one DiT forward, whole, for a step cache to run in parts.

A step cache (``components.cache.stack``) runs a DiT's block stack on subsets of the
requests of one forward: ``Streams`` holds what the blocks read, every request's rows
back to back, whole on every rank (a part of the stack shards them again as it runs,
under sequence parallel), so any subset can be taken out and packed anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["StreamStack", "Streams", "owned"]

# B requests, E width, L_i / N_i text / image tokens of request i


class Streams(NamedTuple):
    """What a DiT's blocks read, for every request of a forward, in request order.

    Attributes:
        text: every request's text rows back to back ``(sum L_i, E)`` (the joint text of
            Flux and SD3, the caption PixArt's cross-attention reads).
        image: every request's image rows ``(sum N_i, E)``.
        text_counts: ``L_i`` of each request.
        image_counts: ``N_i`` of each request.
        condition: each request's conditioning ``(B, ...)``.
        rotation: each request's rotation of its joint tokens, text then image
            ``(sum L_i + N_i, D/2)`` (Flux), or None.
    """

    text: torch.Tensor
    image: torch.Tensor
    text_counts: tuple[int, ...]
    image_counts: tuple[int, ...]
    condition: torch.Tensor
    rotation: torch.Tensor | None = None

    def select(self, requests: Sequence[int]) -> Streams:
        """Return the streams of ``requests`` alone, in that order."""
        joint = [t + n for t, n in zip(self.text_counts, self.image_counts, strict=True)]
        return Streams(
            text=_pick(self.text, self.text_counts, requests),
            image=_pick(self.image, self.image_counts, requests),
            text_counts=tuple(self.text_counts[i] for i in requests),
            image_counts=tuple(self.image_counts[i] for i in requests),
            condition=self.condition[list(requests)],
            rotation=None if self.rotation is None else _pick(self.rotation, joint, requests),
        )

    def images(self) -> list[torch.Tensor]:
        """Return each request's image rows ``(N_i, E)`` (views)."""
        return list(torch.split(self.image, list(self.image_counts)))

    def with_images(self, images: Sequence[torch.Tensor]) -> Streams:
        """Return these streams with each request's image rows replaced."""
        return self._replace(image=torch.cat(list(images)))


def _pick(whole: torch.Tensor, counts: Sequence[int], requests: Sequence[int]) -> torch.Tensor:
    """Return the rows of ``requests`` (each owning ``counts[i]`` consecutive rows), in order."""
    parts = torch.split(whole, list(counts))
    return torch.cat([parts[i] for i in requests]) if requests else whole[:0]


def owned(taken: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Return ``taken`` (this rank's rows of ``whole``) as a tensor blocks may change in place.

    Unsharded, taking a rank's rows returns the whole tensor itself, which the streams
    own: that one is copied.
    """
    return taken.clone() if taken is whole else taken


class StreamStack(nn.Module):
    """A block stack over ``Streams``: what a step cache needs of it beyond its blocks.

    Subclasses implement ``depth`` and ``run_blocks``; with the three methods here they
    are a ``components.cache.CachedStack`` of ``Streams``.
    """

    def depth(self) -> int:
        """Return the blocks of the stack, in the order they run."""
        raise NotImplementedError

    def run_blocks(self, state: Streams, start: int, stop: int) -> Streams:
        """Run blocks ``start`` to ``stop`` (exclusive) on every request of ``state``.

        ``state`` is left as it was; under sequence parallel its rows are sharded for the
        blocks and gathered whole again after them.
        """
        raise NotImplementedError

    def select(self, state: Streams, rows: Sequence[int]) -> Streams:
        """Return the streams of requests ``rows`` alone."""
        return state.select(rows)

    def images(self, state: Streams) -> list[torch.Tensor]:
        """Return each request's image rows ``(N_i, E)``."""
        return state.images()

    def with_images(self, state: Streams, images: Sequence[torch.Tensor]) -> Streams:
        """Return ``state`` with each request's image rows replaced."""
        return state.with_images(images)
