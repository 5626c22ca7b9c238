"""Parallel layouts: how a pipeline is split over processes."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

__all__ = ["ParallelLayout"]

Degree = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class ParallelLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The parallel layout of a pipeline.

    Attributes:
        tp_size: tensor-parallel degree.
        sp_degree: sequence-parallel degree; equals ulysses x ring x kv_gather.
        ulysses_degree: Ulysses (all-to-all over heads) degree.
        ring_degree: ring-attention degree; needs a backend exposing softmax LSE.
        kv_gather_degree: K/V all-gather degree; only with ulysses = ring = 1.
        dp_size: data-parallel replicas.
        cfg_parallel: split the conditional and unconditional CFG branches.
        fsdp: names of the components whose weights are sharded with FSDP.
        timeout_s: how long a collective waits for a peer before the process group fails
            it (a dead or stuck rank ends the run after this, never hangs it).
    """

    tp_size: Degree = 1
    sp_degree: Degree = 1
    ulysses_degree: Degree = 1
    ring_degree: Degree = 1
    kv_gather_degree: Degree = 1
    dp_size: Degree = 1
    cfg_parallel: bool = False
    fsdp: frozenset[str] = frozenset()
    timeout_s: Seconds = 60.0

    @property
    def world_size(self) -> int:
        """Return the number of processes the layout needs."""
        return self.tp_size * self.sp_degree * self.dp_size * (2 if self.cfg_parallel else 1)

    def splits(self, component: str) -> tuple[str, ...]:
        """Name each setting that shards ``component`` across ranks (none: replicated).

        Data parallel and CFG parallel replicate a model; tensor, sequence (Ulysses,
        ring, K/V gather) parallelism and FSDP split it.
        """
        degrees = {
            "tp_size": self.tp_size,
            "sp_degree": self.sp_degree,
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "kv_gather_degree": self.kv_gather_degree,
        }
        split = [f"{key} = {degree}" for key, degree in degrees.items() if degree > 1]
        return (*split, *(["fsdp"] if component in self.fsdp else []))

    def check(self) -> tuple[str, ...]:
        """Return every invariant across keys that this layout breaks."""
        problems: list[str] = []
        product = self.ulysses_degree * self.ring_degree * self.kv_gather_degree
        if self.sp_degree != product:
            problems.append(
                f"sp_degree is {self.sp_degree} but ulysses_degree x ring_degree x "
                f"kv_gather_degree is {self.ulysses_degree} x {self.ring_degree} x "
                f"{self.kv_gather_degree} = {product}"
            )
        if self.kv_gather_degree > 1 and (self.ulysses_degree > 1 or self.ring_degree > 1):
            problems.append(
                f"kv_gather_degree {self.kv_gather_degree} > 1 needs ulysses_degree = "
                f"ring_degree = 1, got {self.ulysses_degree} and {self.ring_degree}"
            )
        return tuple(problems)

    def check_heads(self, heads: int, *, tensor: bool, sequence: bool) -> str | None:
        """Return why ``heads`` attention heads cannot be split by this layout, if so.

        ``tensor`` and ``sequence`` say which splits the component's kind implements: tp
        divides the heads of the first, Ulysses those of the second.
        """
        degrees = {
            name: degree
            for name, degree, applies in (
                ("tp_size", self.tp_size, tensor),
                ("ulysses_degree", self.ulysses_degree, sequence),
            )
            if applies
        }
        split = math.prod(degrees.values())
        if heads % split:
            return (
                f"{heads} heads are not divisible by {' x '.join(degrees)} = "
                f"{' x '.join(map(str, degrees.values()))} = {split}"
            )
        return None
