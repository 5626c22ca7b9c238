"""Requests packed back to back into one token sequence, and the share of it a rank holds."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.functional import pad

from attention.distributed.traffic import record

__all__ = ["Packing", "gather_rows"]

# B requests, T packed tokens (sum of N_i), P ranks


class Packing(NamedTuple):
    """Where each request's tokens lie in the packed ``(T, E)`` rows this rank holds.

    Unsharded, the rows are the whole sequence. Under sequence parallel the sequence is
    padded to a multiple of the shard count with a segment of its own, and a rank holds
    one contiguous shard: ``counts`` are then the rows of each request on this rank
    (possibly 0: requests straddle shard boundaries), ``padding`` the padding rows
    after them, and ``bounds`` the boundaries of every segment of the whole sequence.
    """

    counts: list[int]  # rows of request i here
    token_requests: torch.Tensor  # (T,) int64: the request of each row (padding: 0)
    cu_seqlens: tuple[int, ...]  # B + 1 boundaries (unsharded), host integers
    max_seqlen: int
    padding: int = 0
    bounds: tuple[int, ...] = ()

    @classmethod
    def of(cls, counts: list[int], device: torch.device) -> Packing:
        """Describe requests of ``counts`` tokens packed back to back.

        Everything is read from the host's ``counts``, never from a tensor's values: under
        torch.compile reading those is a graph break, and on a GPU a device sync.
        """
        repeats = torch.tensor(counts, dtype=torch.int64, device=device)
        # output_size: the rows are known on the host, so the op's shape is not data's
        requests = torch.arange(len(counts), device=device).repeat_interleave(
            repeats, output_size=sum(counts)
        )
        return cls(counts, requests, tuple(itertools.accumulate(counts, initial=0)), max(counts))

    @classmethod
    def shard(cls, counts: list[int], shards: int, rank: int, device: torch.device) -> Packing:
        """Describe shard ``rank`` of ``shards`` of the padded packed sequence."""
        whole = cls.of(counts, device)
        total = sum(counts)
        padded = -(-total // shards) * shards
        ends = whole.cu_seqlens
        bounds = (*ends, padded) if padded > total else tuple(ends)
        lo, hi = rank * padded // shards, (rank + 1) * padded // shards
        here = [max(0, min(b, hi) - max(a, lo)) for a, b in itertools.pairwise(ends)]
        requests = pad(whole.token_requests, (0, padded - total))[lo:hi]  # (T/P,)
        return cls(here, requests, whole.cu_seqlens, whole.max_seqlen, hi - lo - sum(here), bounds)

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """Spread per-request ``values`` ``(B, ...)`` over this rank's rows: ``(T, ...)``."""
        return values[self.token_requests]


def gather_rows(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather every rank's ``(T/P, C)`` rows of the group in rank order: ``(T, C)``."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(rows) for _ in range(world)]
    record("output_gather", rows, world - 1)
    dist.all_gather(parts, rows.contiguous(), group=group)
    return torch.cat(parts)
