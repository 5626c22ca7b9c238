"""Sequence-parallel self-attention over packed sequences whose tokens are sharded by rank.

The packed sequence (requests back to back, then a padding segment of its own that makes
the total a multiple of the shard count) is cut into equal contiguous shards, shard ``r``
on sequence rank ``r``; a request may straddle a shard boundary. Shards are never cut at
request boundaries; instead every kernel call is restricted to one request: the global
boundaries ``bounds`` (the ``cu_seqlens`` of the padded sequence) are intersected with
the query rows a rank holds and with the rows of each K/V block it sees, and each
intersection pair is attended alone. So a query row only ever meets keys of its own
request, whichever ranks they lie on:

- Ulysses: after the all-to-all a rank holds its head group for a contiguous chunk (the
  whole sequence without ring), and attends it with the global boundaries shifted to it;
- K/V gather: a rank gathers every K/V row and attends its query rows with the
  boundaries clipped to them;
- ring: each arriving K/V block is attended pair by pair with the softmax LSE, and the
  partial results merge by it (a row with no keys in a block skips it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist

from attention.distributed.local import LocalAttention, LocalKernel
from attention.distributed.ring import Ring, requires_lse
from attention.distributed.traffic import record
from attention.distributed.ulysses import kv_repeat, shard_heads, shard_sequence
from attention.packing import as_batch, attend_segments

__all__ = ["packed_sequence_attention"]

# H heads, D head dim, T packed tokens (padded), P ranks; Tl = T / P rows on one rank

Pair = tuple[int, int, int, int]  # query rows q0:q1 attend key rows k0:k1 (local indices)

_all_gather_single: Callable[..., object] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)


def packed_sequence_attention(
    q: torch.Tensor,  # (Tl, Hq, D)
    k: torch.Tensor,  # (Tl, Hk, D)
    v: torch.Tensor,  # (Tl, Hk, D)
    attend: LocalAttention,
    bounds: Sequence[int],
    *,
    ulysses: dist.ProcessGroup | None = None,
    ring: dist.ProcessGroup | None = None,
    kv_gather: dist.ProcessGroup | None = None,
    varlen: bool = True,
) -> torch.Tensor:
    """Attend this rank's token shard within each packed request; returns ``(Tl, Hq, D)``.

    The sequence rank is ``ring_rank * ulysses_size + ulysses_rank`` (Ulysses inside
    ring), or the K/V gather rank. Attention is non-causal.

    Args:
        q, k, v: this rank's rows of the packed sequence.
        attend: the local layer or kernel.
        bounds: the boundaries of every segment of the whole padded sequence, from 0 to T.
        ulysses: the Ulysses group (heads for tokens), or None.
        ring: the ring group (needs a backend with softmax LSE), or None.
        kv_gather: the K/V gather group (only without Ulysses and ring), or None.
        varlen: attend with one ``forward_varlen`` call; False runs one dense call per
            request (a backend without packed varlen).

    Raises:
        BackendSelectionError: ``parallel.ring_requires_lse`` for a ring without LSE.
        ValueError: the query heads do not divide by the Ulysses group.
    """
    kernel = LocalKernel(attend, None)
    if ring is not None and not kernel.supports_lse():
        raise requires_lse(kernel)
    width = 1 if ulysses is None else dist.get_world_size(ulysses)
    if ulysses is not None and width > 1:
        q, k, v = _heads_for_tokens(q, k, v, ulysses, width)  # (Tc, H/U, D) each
    chunk = q.shape[0]
    if ring is not None:
        out = _ring(kernel, q, k, v, bounds, ring)
    elif kv_gather is not None:
        start = dist.get_rank(kv_gather) * chunk
        k, v = _gather_kv(k, v, kv_gather)  # (T, Hk, D) each
        out = _attend(kernel, q, k, v, _pairs(bounds, start, chunk, 0, k.shape[0]), varlen)
    else:
        out = _attend(kernel, q, k, v, _pairs(bounds, 0, chunk, 0, chunk), varlen)
    if ulysses is not None and width > 1:
        out = shard_sequence(out.transpose(0, 1)[None], width, ulysses)[0].transpose(0, 1)
    return out  # (Tl, Hq, D)


def _heads_for_tokens(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trade ``(Tl, H, D)`` token shards for ``(Tl * U, H / U, D)`` head shards."""
    hq, hk = q.shape[1], k.shape[1]
    if hq % width:
        raise ValueError(
            f"ulysses attention splits the query heads over the {width} ranks of its group, "
            f"but q has {hq} heads; make the heads a multiple of parallel.ulysses_degree"
        )
    repeat = kv_repeat(hq, hk, width)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    parts = shard_heads(tuple(t.transpose(0, 1)[None] for t in (q, k, v)), width, group)
    qh, kh, vh = (t[0].transpose(0, 1) for t in parts)  # (Tc, H/U, D)
    return qh, kh, vh


def _gather_kv(
    k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's K/V rows, in rank order: ``(T, Hk, D)`` each."""
    world = dist.get_world_size(group)
    kv = torch.stack((k, v))  # (2, Tl, Hk, D)
    gathered = kv.new_empty((world * 2, *kv.shape[1:]))
    record("all_gather", kv, world - 1)
    _all_gather_single(gathered, kv, group=group)
    full = gathered.view(world, 2, *kv.shape[1:]).transpose(0, 1)  # (2, P, Tl, Hk, D)
    full = full.reshape(2, world * kv.shape[1], *kv.shape[2:])
    return full[0], full[1]


def _pairs(bounds: Sequence[int], q_start: int, q_len: int, k_start: int, k_len: int) -> list[Pair]:
    """Intersect each segment with the query rows and the key rows held; keep both non-empty."""
    found = []
    for lo, hi in itertools.pairwise(bounds):
        q0, q1 = max(lo, q_start), min(hi, q_start + q_len)
        k0, k1 = max(lo, k_start), min(hi, k_start + k_len)
        if q0 < q1 and k0 < k1:
            found.append((q0 - q_start, q1 - q_start, k0 - k_start, k1 - k_start))
    return found


def _attend(
    kernel: LocalKernel,
    q: torch.Tensor,  # (Tq, Hq, D)
    k: torch.Tensor,  # (Tk, Hk, D)
    v: torch.Tensor,  # (Tk, Hk, D)
    pairs: list[Pair],
    varlen: bool,
) -> torch.Tensor:
    """Attend every pair; every query row lies in exactly one pair here."""
    if not varlen:
        return attend_segments(partial(kernel.forward, is_causal=False), q, k, v, pairs)
    first, last = pairs[0], pairs[-1]
    cu_q = torch.tensor([first[0], *(p[1] for p in pairs)], device=q.device) - first[0]
    cu_k = torch.tensor([first[2], *(p[3] for p in pairs)], device=q.device) - first[2]
    return kernel.forward_varlen(
        q[first[0] : last[1]],
        k[first[2] : last[3]],
        v[first[2] : last[3]],
        cu_q.to(torch.int32),
        cu_k.to(torch.int32),
        max(p[1] - p[0] for p in pairs),
        max(p[3] - p[2] for p in pairs),
    )


def _ring(
    kernel: LocalKernel,
    q: torch.Tensor,  # (Tc, Hq, D)
    k: torch.Tensor,  # (Tc, Hk, D)
    v: torch.Tensor,  # (Tc, Hk, D)
    bounds: Sequence[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Pass K/V blocks around the ring and merge each pair's partial result by its LSE."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)  # (Tc, Hq, D)
    lse = torch.full(q.shape[:2], -torch.inf, dtype=acc, device=q.device)  # (Tc, Hq)
    ring = Ring(group, rank, world)
    kv = torch.stack((k, v))  # (2, Tc, Hk, D): one message per step
    if world > 1:
        ring.pass_on(kv)
    for step in range(world):
        if step > 0:
            kv = ring.arrived()
            if step < world - 1:
                ring.pass_on(kv)  # in flight while this block is attended
        source = (rank - step) % world  # the rank this K/V block belongs to
        for q0, q1, k0, k1 in _pairs(bounds, rank * chunk, chunk, source * chunk, chunk):
            o, block_lse = kernel.forward_with_lse(
                as_batch(q, q0, q1),
                as_batch(kv[0], k0, k1),
                as_batch(kv[1], k0, k1),
                is_causal=False,
            )  # (1, Hq, n, D), (1, Hq, n)
            o, block_lse = o[0].transpose(0, 1).to(acc), block_lse[0].transpose(0, 1).to(acc)
            merged = torch.logaddexp(lse[q0:q1], block_lse)  # (n, Hq)
            out[q0:q1] = out[q0:q1] * torch.exp(lse[q0:q1] - merged).unsqueeze(-1) + o * torch.exp(
                block_lse - merged
            ).unsqueeze(-1)
            lse[q0:q1] = merged
    return out.to(q.dtype)
