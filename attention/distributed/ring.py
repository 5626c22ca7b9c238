"""Ring attention: K/V blocks travel around the ring; partial results merge by their LSE.

Each rank keeps its query shard and attends it to one K/V block per step while the next
block is already in flight; the partial outputs are combined with the softmax
log-sum-exp, so the result equals attention over the whole sequence without any rank
ever holding all of K and V.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attention import registry
from attention.distributed.local import LocalAttention, LocalKernel
from attention.distributed.traffic import record
from attention.errors import BackendSelectionError, SelectionCode
from attention.layer import Attention

__all__ = ["Ring", "requires_lse", "ring_attention"]

# B batch, H heads, S seq, D head dim, P ranks in the group


def ring_attention(
    q: torch.Tensor,  # (B, Hq, S/P, D)
    k: torch.Tensor,  # (B, Hk, S/P, D)
    v: torch.Tensor,  # (B, Hk, S/P, D)
    attend: LocalAttention,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend this rank's query shard to the whole sequence's K/V; returns ``(B, Hq, S/P, D)``.

    Rank ``r`` holds tokens ``r*S/P .. (r+1)*S/P`` of q, k and v; every rank's K/V shards
    have the same shape (k and v alike). Partial outputs and LSEs accumulate in float32
    (float64 for float64 inputs). Under ``is_causal`` the query and K/V shards must be
    equally long: blocks from later ranks are skipped and a rank's own block is causal, so
    no query row is ever fully masked.

    Args:
        q, k, v: this rank's shards.
        attend: the local attention layer or kernel; its backend must expose the softmax
            LSE, and a layer must be allowed to return it (built under a ring scope, or
            declaring ``softmax_lse``).
        group: the process group (the default group when None).
        is_causal: mask key ``j > i`` for query ``i`` over the whole sequence.
        scale: the softmax scale for a bare kernel (a layer uses its own).

    Raises:
        BackendSelectionError: ``parallel.ring_requires_lse`` — the backend does not
            implement softmax LSE; checked before any communication.
        ValueError: causal shards of unequal length, or a scale passed with a layer.
    """
    kernel = LocalKernel(attend, scale)
    if not kernel.supports_lse():
        raise requires_lse(kernel)
    if isinstance(attend, Attention) and not attend.lse_allowed:
        raise ValueError(
            f"{kernel.where} may not return the softmax LSE: build it inside a "
            "component scope with ring attention, or declare softmax_lse in its requirements"
        )
    if is_causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"causal ring attention needs query and K/V shards of one length, got "
            f"{q.shape[-2]} query and {k.shape[-2]} key tokens on this rank; shard q, k and v "
            "along the same sequence"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ring = Ring(group, rank, world)
    kv = torch.stack((k, v))  # (2, B, Hk, S/P, D): one message per step
    if world > 1:
        ring.pass_on(kv)
    out, lse = kernel.forward_with_lse(q, k, v, is_causal=is_causal)
    acc = torch.promote_types(q.dtype, torch.float32)
    out, lse = out.to(acc), lse.to(acc)  # (B, Hq, S/P, D), (B, Hq, S/P)
    for step in range(1, world):
        kv = ring.arrived()
        if step < world - 1:
            ring.pass_on(kv)  # in flight while this block is attended
        source = (rank - step) % world  # the rank this K/V block belongs to
        if is_causal and source > rank:
            continue  # every key of a later rank lies after every local query
        block_out, block_lse = kernel.forward_with_lse(q, kv[0], kv[1], is_causal=False)
        out, lse = _merge(out, lse, block_out, block_lse)
    return out.to(q.dtype)


def _merge(
    out: torch.Tensor,  # (B, H, Sq, D)
    lse: torch.Tensor,  # (B, H, Sq)
    block_out: torch.Tensor,  # (B, H, Sq, D)
    block_lse: torch.Tensor,  # (B, H, Sq)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial outputs over disjoint keys by their LSEs.

    The weights ``exp(lse - merged)`` are at most 1, so nothing overflows; both LSEs are
    finite because no computed block has a fully masked row.
    """
    merged = torch.logaddexp(lse, block_lse.to(lse.dtype))
    out = out * torch.exp(lse - merged).unsqueeze(-1)
    out += block_out.to(out.dtype) * torch.exp(block_lse.to(lse.dtype) - merged).unsqueeze(-1)
    return out, merged


class Ring:
    """Pass K/V blocks to the next rank of the group and receive the previous rank's.

    Args:
        group: the process group (the default group when None).
        rank: this rank's index in the group.
        world: the group's size.
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.next = (rank + 1) % world
        self.previous = (rank - 1) % world
        self._incoming = torch.empty(0)
        self._works: list[dist.Work] = []

    def pass_on(self, kv: torch.Tensor) -> None:
        """Start sending ``kv`` on and receiving the previous rank's block into a new buffer."""
        self._incoming = torch.empty_like(kv)
        record("ring", kv)
        self._works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, kv, group=self.group, group_peer=self.next),
                dist.P2POp(dist.irecv, self._incoming, group=self.group, group_peer=self.previous),
            ]
        )

    def arrived(self) -> torch.Tensor:
        """Wait for the transfer ``pass_on`` started and return the received block."""
        for work in self._works:
            work.wait()
        return self._incoming


def requires_lse(kernel: LocalKernel) -> BackendSelectionError:
    name = kernel.backend_name
    capable = ", ".join(n for n in registry.names() if registry.get(n).supports_lse())
    return BackendSelectionError(
        SelectionCode.RING_REQUIRES_LSE,
        kernel.component,
        f"backend '{name}' does not implement softmax LSE, which ring attention on "
        f"{kernel.where} requires to merge the partial results of its K/V blocks",
        f"pick a backend with softmax LSE ({capable}) for component '{kernel.component}', "
        "or run it without ring attention (ring degree 1; ulysses and K/V gather need no LSE)",
    )
