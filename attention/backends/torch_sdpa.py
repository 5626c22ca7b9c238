"""``torch_sdpa``: PyTorch's scaled_dot_product_attention, with masks, a bias and causality.

It overrides neither ``forward_varlen`` nor ``forward_with_lse``: SDPA exposes no
log-sum-exp and no packed-sequence entry point, and a loop around it would be a
capability granted by a shortcut rather than by the kernel. Its float ``attn_mask`` is
added to the scores as it is, which is what an additive bias needs.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from attention.backend import AttentionBackend, AttentionImpl
from attention.masks import as_4d

__all__ = ["TorchSdpaBackend", "sdpa_masked"]

# B batch, H heads, S seq, D head dim


class TorchSdpaImpl(AttentionImpl):
    """Call ``scaled_dot_product_attention``; grouped-query K/V go through ``enable_gqa``."""

    def forward(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with SDPA."""
        return scaled_dot_product_attention(
            q, k, v, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
        )  # (B, Hq, Sq, D)

    def forward_causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend causally with SDPA's own causal mode."""
        return scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
        )

    def forward_masked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor,  # bool or additive, broadcastable to (B, Hq, Sq, Sk)
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with SDPA under a boolean or additive mask."""
        return sdpa_masked(q, k, v, attn_mask, scale=scale)

    def forward_biased(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,  # float, broadcastable to (B, Hq, Sq, Sk)
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend with ``bias`` added to the scores: SDPA adds a float mask as it is."""
        return sdpa_masked(q, k, v, bias.to(q.dtype), scale=scale)


def sdpa_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor,
    *,
    scale: float | None,
) -> torch.Tensor:
    """Call SDPA with a mask in the form every one of its kernels accepts (2-D or 4-D)."""
    return scaled_dot_product_attention(
        q, k, v, attn_mask=as_4d(attn_mask), scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
    )


class TorchSdpaBackend(AttentionBackend):
    """Describe ``torch_sdpa``: available wherever torch is, the CPU platform default."""

    name = "torch_sdpa"
    impl_cls = TorchSdpaImpl
