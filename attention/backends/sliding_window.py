"""``sliding_window``: local attention in which query ``i`` sees keys ``|i - j| <= window``.

Computed blockwise: queries are cut into blocks, and each block attends only to the
keys its window can reach, so time and memory grow as S·W, never S². It is sparse (an
approximation of dense attention): never used for cross-attention, never a fallback.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch
from torch.nn.functional import pad, scaled_dot_product_attention

from attention.backend import AttentionBackend, AttentionImpl
from attention.masks import additive_mask

__all__ = ["SlidingWindowBackend", "SlidingWindowOptions"]

# B batch, H heads, S seq, D head dim, N query blocks, L block length, K keys a block sees

# Blocks longer than this only add padding work at the sequence end.
_MAX_BLOCK = 128


class SlidingWindowOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Validate ``[attention.backend_options.sliding_window]``.

    Attributes:
        window: how many positions on each side of a query it sees (before it only, when
            causal).
    """

    window: Annotated[int, msgspec.Meta(ge=1)] = 256


class SlidingWindowImpl(AttentionImpl):
    """Attend each query block to the band of keys within the window, batched over blocks."""

    def __init__(self, options: SlidingWindowOptions) -> None:
        super().__init__(options)
        self.window = options.window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend each query to the keys within ``window`` positions of it on either side."""
        return self._attend(q, k, v, is_causal=False, scale=scale)

    def forward_causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend each query to itself and the ``window`` keys before it."""
        return self._attend(q, k, v, is_causal=True, scale=scale)

    def _attend(
        self,
        q: torch.Tensor,  # (B, Hq, S, D)
        k: torch.Tensor,  # (B, Hk, S, D)
        v: torch.Tensor,  # (B, Hk, S, D)
        *,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend within the window, blockwise.

        Raises:
            ValueError: k does not have as many positions as q (a window is a self-attention
                notion).
        """
        b, hq, s, d = q.shape
        if k.shape[-2] != s:
            raise ValueError(
                f"sliding-window attention needs as many keys as queries, got {s} queries "
                f"and {k.shape[-2]} keys; use a dense backend for this layer"
            )
        gqa = hq != k.shape[-3]
        if s - 1 <= self.window:
            # Every key is within reach of every query: this is dense attention.
            return scaled_dot_product_attention(
                q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa
            )
        left, right = self.window, 0 if is_causal else self.window
        block = min(self.window, _MAX_BLOCK)
        n = -(-s // block)
        span = block + left + right  # K
        tail = n * block - s  # padding that rounds S up to whole blocks
        hk = k.shape[-3]
        # Blocks join the batch dimension so the fused 4-D kernel runs them all in one call.
        qb = pad(q, (0, 0, 0, tail)).view(b, hq, n, block, d).transpose(1, 2)  # (B, N, Hq, L, D)
        kb = _bands(k, left, tail + right, span, block).reshape(b * n, hk, span, d)
        vb = _bands(v, left, tail + right, span, block).reshape(b * n, hk, span, d)
        mask = additive_mask(_band_mask(n, block, span, left, s, q.device), q.dtype)
        out = scaled_dot_product_attention(
            qb.reshape(b * n, hq, block, d),
            kb,
            vb,
            attn_mask=mask.expand(b, n, 1, block, span).reshape(b * n, 1, block, span),
            scale=scale,
            enable_gqa=gqa,
        )  # (B·N, Hq, L, D)
        return out.view(b, n, hq, block, d).transpose(1, 2).reshape(b, hq, n * block, d)[:, :, :s]


def _bands(x: torch.Tensor, before: int, after: int, span: int, block: int) -> torch.Tensor:
    """Cut ``(B, H, S, D)`` into the ``(B, N, H, K, D)`` key windows of each query block."""
    padded = pad(x, (0, 0, before, after))  # (B, H, before + S + after, D)
    # unfold is a view; the caller's reshape copies it once: N·K = S·(1 + 2W/L) rows, linear.
    return padded.unfold(2, span, block).permute(0, 2, 1, 4, 3)  # (B, N, H, K, D)


def _band_mask(
    n: int, block: int, span: int, left: int, s: int, device: torch.device
) -> torch.Tensor:
    """Return the ``(N, 1, L, K)`` boolean mask of the keys each query of each block sees."""
    row = torch.arange(block, device=device).unsqueeze(1)  # (L, 1)
    col = torch.arange(span, device=device).unsqueeze(0)  # (1, K)
    # Block-local column c is key j = start + c - left; the band is i - left <= j <= i + right.
    band = (col >= row) & (col <= row + span - block)  # (L, K)
    key = torch.arange(n, device=device).unsqueeze(1) * block + col - left  # (N, K)
    real = (key >= 0) & (key < s)  # padding keys take no part
    return (band.unsqueeze(0) & real.unsqueeze(1)).unsqueeze(1)  # (N, 1, L, K)


class SlidingWindowBackend(AttentionBackend):
    """Describe ``sliding_window``: sparse, dense inputs only, the window from its options."""

    name = "sliding_window"
    impl_cls = SlidingWindowImpl
    options_type = SlidingWindowOptions
    is_sparse = True
