"""Read the segment boundaries of packed variable-length sequences, and attend per segment."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TypeAlias

import torch

from attention.backend import AttentionImpl

__all__ = ["Boundaries", "PerSegmentVarlen", "as_batch", "as_tensor", "attend_segments"]

# B batch, H heads, S seq, D head dim, T packed tokens

Boundaries: TypeAlias = torch.Tensor | Sequence[int]
"""Where packed sequences start and end (``cu_seqlens``): an int32 tensor, as flash-attn
takes them, or the same integers on the host."""


def on_host(cu_seqlens: Boundaries) -> list[int]:
    """Return boundaries as host integers: a tensor's values are read (a device sync, and a
    graph break under torch.compile), host integers are taken as they are."""
    if isinstance(cu_seqlens, torch.Tensor):
        return [int(x) for x in cu_seqlens.tolist()]
    return list(cu_seqlens)


def as_tensor(cu_seqlens: Boundaries, device: torch.device) -> torch.Tensor:
    """Return boundaries as a tensor on ``device`` (int32 where they were host integers)."""
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    return torch.tensor(cu_seqlens, dtype=torch.int32, device=device)


def segments(
    cu_seqlens_q: Boundaries, cu_seqlens_k: Boundaries, total_q: int, total_k: int
) -> list[tuple[int, int, int, int]]:
    """Return ``(q_start, q_end, k_start, k_end)`` for each packed sequence.

    Raises:
        ValueError: the two boundaries disagree on the number of sequences, do not start
            at 0, decrease, or do not end at the packed lengths ``total_q``/``total_k``.
    """
    bounds_q = on_host(cu_seqlens_q)
    bounds_k = on_host(cu_seqlens_k)
    if len(bounds_q) != len(bounds_k):
        raise ValueError(
            f"cu_seqlens_q describes {len(bounds_q) - 1} sequences but cu_seqlens_k "
            f"{len(bounds_k) - 1}; pass one boundary per sequence to both"
        )
    for label, bounds, total in (("q", bounds_q, total_q), ("k", bounds_k, total_k)):
        if not bounds or bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(
                f"cu_seqlens_{label} must run from 0 to {total} (the packed length), got {bounds}"
            )
        if any(a > b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"cu_seqlens_{label} must not decrease, got {bounds}")
    return [
        (bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1])
        for i in range(len(bounds_q) - 1)
    ]


def as_batch(packed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """View rows ``start:end`` of a packed ``(T, H, D)`` tensor as one ``(1, H, S, D)`` batch."""
    return packed[start:end].transpose(0, 1).unsqueeze(0)


def attend_segments(
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,  # (Tq, Hq, D)
    k: torch.Tensor,  # (Tk, Hk, D)
    v: torch.Tensor,  # (Tk, Hk, D)
    bounds: Iterable[tuple[int, int, int, int]],
) -> torch.Tensor:
    """Attend each ``(q_start, q_end, k_start, k_end)`` segment alone, into one packed output.

    ``attend`` is a dense kernel on ``(1, H, S, D)`` batches. This is how a kernel
    without a varlen entry of its own (torch has none on CPU) serves packed
    sequences. Every query row must lie in one segment; an empty one is skipped.
    """
    out = q.new_empty(q.shape)  # (Tq, Hq, D)
    for q0, q1, k0, k1 in bounds:
        if q1 == q0:
            continue
        seg = attend(as_batch(q, q0, q1), as_batch(k, k0, k1), as_batch(v, k0, k1))
        out[q0:q1] = seg[0].transpose(0, 1)  # (1, Hq, Sq_i, D) -> (Sq_i, Hq, D)
    return out


class PerSegmentVarlen(AttentionImpl):
    """Serve packed sequences with one ``forward`` call per sequence.

    For kernels with no varlen entry of their own: torch has none on CPU, where a loop
    over a fused kernel is still far cheaper than padding. The loop needs the boundaries
    on the host: given as host integers (``Attention.forward_varlen`` passes them on as
    they came), they are not read back from a tensor.
    """

    def forward_varlen(
        self,
        q: torch.Tensor,  # (Tq, Hq, D)
        k: torch.Tensor,  # (Tk, Hk, D)
        v: torch.Tensor,  # (Tk, Hk, D)
        cu_seqlens_q: Boundaries,
        cu_seqlens_k: Boundaries,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """Run ``forward`` (``forward_causal`` when causal) once per packed sequence, writing
        into one packed output."""
        forward = partial(self.forward_causal if is_causal else self.forward, scale=scale)
        bounds = segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
        return attend_segments(forward, q, k, v, bounds)
