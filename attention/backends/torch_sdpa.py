"""``torch_sdpa``: PyTorch's scaled_dot_product_attention, with masks, without LSE or varlen.

It overrides neither ``forward_varlen`` nor ``forward_with_lse``: SDPA exposes no
log-sum-exp and no packed-sequence entry point, and a loop around it would be a
capability granted by a shortcut rather than by the kernel.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from attention.backend import AttentionBackend, AttentionImpl
from attention.masks import as_4d, with_causal

# B batch, H heads, S seq, D head dim


class TorchSdpaImpl(AttentionImpl):
    """Call ``scaled_dot_product_attention``; grouped-query K/V go through ``enable_gqa``."""

    def forward(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with SDPA."""
        return scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
        )  # (B, Hq, Sq, D)

    def forward_masked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor,  # bool or additive, broadcastable to (B, Hq, Sq, Sk)
        *,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with SDPA under a boolean or additive mask."""
        return sdpa_masked(q, k, v, attn_mask, is_causal=is_causal, scale=scale)


def sdpa_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor,
    *,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """Call SDPA with a mask in the form every one of its kernels accepts."""
    if is_causal:
        # Some SDPA kernels refuse a mask together with is_causal: fold it in.
        attn_mask = with_causal(attn_mask, q.shape[-2], k.shape[-2])
    return scaled_dot_product_attention(
        q, k, v, attn_mask=as_4d(attn_mask), scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
    )


class TorchSdpaBackend(AttentionBackend):
    """Describe ``torch_sdpa``: available wherever torch is, the CPU platform default."""

    name = "torch_sdpa"
    impl_cls = TorchSdpaImpl
