"""Ulysses attention: trade sequence shards for head shards with all-to-all, attend, trade back.

Each rank holds the whole head set for ``S/P`` tokens; after one all-to-all it holds
``H/P`` heads for all ``S`` tokens, runs the ordinary kernel (no LSE needed), and a second
all-to-all returns its own tokens with every head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attention.distributed.local import LocalAttention, LocalKernel
from attention.distributed.traffic import record

__all__ = ["kv_repeat", "shard_heads", "shard_sequence", "ulysses_attention"]

# B batch, H heads, S seq, D head dim, P ranks in the group


def ulysses_attention(
    q: torch.Tensor,  # (B, Hq, S/P, D)
    k: torch.Tensor,  # (B, Hk, S/P, D)
    v: torch.Tensor,  # (B, Hk, S/P, D)
    attend: LocalAttention,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend this rank's sequence shard over the whole sequence; returns ``(B, Hq, S/P, D)``.

    Rank ``r`` holds tokens ``r*S/P .. (r+1)*S/P`` of q, k and v; every rank holds shards of
    the same shape, dtype and head dim. Query heads must divide evenly over the group.
    Grouped-query K/V heads are split too when they divide evenly; otherwise each K/V head is
    repeated the fewest times that makes them divide (exact, at the cost of sending the
    copies).

    Args:
        q, k, v: this rank's shards.
        attend: the local attention layer or kernel.
        group: the process group (the default group when None).
        is_causal: mask key ``j > i`` for query ``i`` over the whole sequence.
        scale: the softmax scale for a bare kernel (a layer uses its own).

    Raises:
        ValueError: the query heads do not divide by the group size, or a scale was passed
            with a layer.
    """
    kernel = LocalKernel(attend, scale)
    world = dist.get_world_size(group)
    hq, hk = q.shape[-3], k.shape[-3]
    if hq % world:
        raise ValueError(
            f"ulysses attention splits the query heads over the {world} ranks of its group, "
            f"but q has {hq} heads, which {world} does not divide; make the heads a multiple "
            f"of the ulysses degree (parallel.ulysses_degree), or use ring or K/V gather "
            "attention for this layer"
        )
    repeat = kv_repeat(hq, hk, world)
    if repeat > 1:
        k = k.repeat_interleave(repeat, dim=-3)  # (B, Hk*repeat, S/P, D)
        v = v.repeat_interleave(repeat, dim=-3)
    qh, kh, vh = shard_heads((q, k, v), world, group)  # (B, H/P, S, D) each
    out = kernel.forward(qh, kh, vh, is_causal=is_causal)  # (B, Hq/P, S, D)
    return shard_sequence(out, world, group)


def kv_repeat(hq: int, hk: int, world: int) -> int:
    """Return the fewest copies of each K/V head that split evenly and keep the grouping.

    Repeating by ``r`` keeps query head ``i`` on a copy of K/V head ``i // (hq // hk)`` as
    long as ``r`` divides the group size ``hq // hk``; ``r = hq // hk`` always works because
    the query heads divide by ``world``.
    """
    groups = hq // hk
    return next(r for r in range(1, groups + 1) if groups % r == 0 and (hk * r) % world == 0)


def shard_heads(
    parts: tuple[torch.Tensor, ...], world: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, ...]:
    """Turn each ``(B, H_i, S/P, D)`` into ``(B, H_i/P, S, D)`` with one all-to-all for all."""
    b, _, shard, d = parts[0].shape
    heads = [p.shape[-3] // world for p in parts]
    # One message for q, k and v: rank j's block holds head group j of each, side by side.
    send = torch.cat(
        [p.reshape(b, world, h, shard, d) for p, h in zip(parts, heads, strict=True)], dim=2
    )  # (B, P, sum H_i/P, S/P, D)
    send = send.movedim(1, 0).contiguous()  # (P, B, sum H_i/P, S/P, D)
    recv = torch.empty_like(send)
    record("all_to_all", send, (world - 1) / world)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens, my heads
    full = recv.permute(1, 2, 0, 3, 4).reshape(b, sum(heads), world * shard, d)
    return torch.split(full, heads, dim=1)


def shard_sequence(
    out: torch.Tensor,  # (B, H/P, S, D)
    world: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Turn ``(B, H/P, S, D)`` back into this rank's tokens with every head, ``(B, H, S/P, D)``."""
    b, h, s, d = out.shape
    send = out.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # (P, B, H/P, S/P, D)
    record("all_to_all", send, (world - 1) / world)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: head group j, my tokens
    return recv.movedim(0, 1).reshape(b, world * h, s // world, d)
