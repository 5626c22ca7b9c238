"""``reference``: attention written out as plain math; the oracle every kernel is tested against.

Scores and softmax are computed explicitly in float32 (float64 for float64 inputs), so
it is exact but slow and memory-hungry (it materialises every score): it is never chosen
automatically, only when requested by name.
"""

from __future__ import annotations

import math

import torch

from attention.backend import AttentionBackend
from attention.masks import additive_mask, causal_mask
from attention.packing import PerSegmentVarlen

__all__ = ["ReferenceBackend"]

# B batch, H heads, S seq, D head dim, T packed tokens


def _attend(
    q: torch.Tensor,  # (B, Hq, Sq, D)
    k: torch.Tensor,  # (B, Hk, Sk, D)
    v: torch.Tensor,  # (B, Hk, Sk, D)
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the output and the LSE; a query that sees no key gets zeros and LSE -inf."""
    compute = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[-3] // k.shape[-3]
    qc = q.to(compute)
    kc = k.to(compute).repeat_interleave(groups, dim=-3)  # (B, Hq, Sk, D)
    vc = v.to(compute).repeat_interleave(groups, dim=-3)
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (qc @ kc.transpose(-2, -1)) * factor  # (B, Hq, Sq, Sk)
    if attn_mask is not None:
        scores = scores + additive_mask(attn_mask, compute)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, Sq)
    # Rows with no visible key have lse -inf; exp(-inf - -inf) is NaN, so give them zeros.
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(nan=0.0)
    return (probs @ vc).to(q.dtype), lse


class ReferenceImpl(PerSegmentVarlen):
    """Compute scores, softmax and the weighted sum explicitly, with every capability.

    Packed sequences run one at a time (``PerSegmentVarlen``).
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v."""
        return _attend(q, k, v, None, is_causal=False, scale=scale)[0]

    def forward_causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend causally; the reference masks its materialised scores."""
        return _attend(q, k, v, None, is_causal=True, scale=scale)[0]

    def forward_masked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v under a boolean or additive mask."""
        return _attend(q, k, v, attn_mask, is_causal=False, scale=scale)[0]

    def forward_biased(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with ``bias`` added to the scores (an additive mask is one)."""
        return _attend(q, k, v, bias, is_causal=False, scale=scale)[0]

    def forward_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend q to k and v and return the LSE in the compute dtype."""
        return _attend(q, k, v, None, is_causal=is_causal, scale=scale)


class ReferenceBackend(AttentionBackend):
    """Describe ``reference``: every capability, never in a fallback chain."""

    name = "reference"
    impl_cls = ReferenceImpl
    is_automatic = False
