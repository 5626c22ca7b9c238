"""K/V gather attention: every rank gathers the whole sequence's K/V and attends its queries.

The layout for sequence parallelism without head or ring splitting (design §6: K/V gather
> 1 only with ulysses = ring = 1): one all-gather, then the ordinary kernel, so any
backend works. It is non-causal: the gathered keys would need a per-rank offset mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from attention.distributed.local import LocalAttention, LocalKernel
from attention.distributed.traffic import record

__all__ = ["kv_gather_attention"]

# B batch, H heads, S seq, D head dim, P ranks in the group

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older torch has only it.
_all_gather_single: Callable[..., object] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)


def kv_gather_attention(
    q: torch.Tensor,  # (B, Hq, Sq/P, D)
    k: torch.Tensor,  # (B, Hk, Sk/P, D)
    v: torch.Tensor,  # (B, Hk, Sk/P, D)
    attend: LocalAttention,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend this rank's queries to the whole sequence's K/V; returns ``(B, Hq, Sq/P, D)``.

    Rank ``r`` holds the ``r``-th equal shard of the keys and values (k and v alike);
    gathered in rank order they are the whole sequence.

    Args:
        q, k, v: this rank's shards.
        attend: the local attention layer or kernel.
        group: the process group (the default group when None).
        scale: the softmax scale for a bare kernel (a layer uses its own).

    Raises:
        ValueError: a scale was passed with a layer.
    """
    kernel = LocalKernel(attend, scale)
    world = dist.get_world_size(group)
    kv = torch.stack((k, v))  # (2, B, Hk, Sk/P, D): one collective for both
    two, b, hk, shard, d = kv.shape
    # Concatenated along dim 0 (gloo takes no stacked output); rank r's block comes r-th.
    gathered = kv.new_empty((world * two, b, hk, shard, d))
    record("all_gather", kv, world - 1)  # this rank's block goes to every other rank
    _all_gather_single(gathered, kv, group=group)
    full = gathered.view(world, two, b, hk, shard, d).permute(1, 2, 3, 0, 4, 5)
    full = full.reshape(two, b, hk, world * shard, d)  # (2, B, Hk, Sk, D)
    return kernel.forward(q, full[0], full[1], is_causal=False)  # (B, Hq, Sq/P, D)
