"""Call an attention layer or a bare kernel the same way from the distributed variants."""

from __future__ import annotations

from typing import TypeAlias

import torch

from attention import registry
from attention.backend import AttentionImpl
from attention.layer import Attention
from attention.scope import UNSCOPED

__all__ = ["LocalAttention", "LocalKernel"]

# B batch, H heads, S seq, D head dim

LocalAttention: TypeAlias = Attention | AttentionImpl
"""What attends on each rank: a layer (its chosen backend, its scale, its arming check)
or a bare ``AttentionImpl`` (the caller passes the scale)."""


class LocalKernel:
    """Run the local attention of one rank, whether it is a layer or a bare kernel.

    Args:
        attend: the layer or kernel.
        scale: the softmax scale for a bare kernel (None means ``1 / sqrt(D)``); a layer
            uses its own, so passing one with a layer is an error.

    Raises:
        ValueError: a scale was passed together with a layer.
    """

    def __init__(self, attend: LocalAttention, scale: float | None) -> None:
        if isinstance(attend, Attention) and scale is not None:
            raise ValueError(
                f"layer '{attend.site}' of component '{attend.component}' has its own softmax "
                f"scale ({attend.scale}), so scale={scale} was not applied; pass scale only "
                "with a bare AttentionImpl, or build the layer with Attention(..., scale=...)"
            )
        self.attend = attend
        self.scale = scale

    @property
    def backend_name(self) -> str:
        """Name the backend that runs: the layer's, else the registered one of the kernel."""
        if isinstance(self.attend, Attention):
            return self.attend.backend_name
        impl_cls = type(self.attend)
        found = [n for n in registry.names() if registry.get(n).impl_cls is impl_cls]
        return found[0] if found else impl_cls.__qualname__

    @property
    def component(self) -> str:
        """Name the component the layer belongs to, or ``<unscoped>`` for a bare kernel."""
        return self.attend.component if isinstance(self.attend, Attention) else UNSCOPED

    @property
    def where(self) -> str:
        """Describe the layer or kernel for a message."""
        if isinstance(self.attend, Attention):
            layer = self.attend
            return f"layer '{layer.site}' ({layer.role.value}) of component '{layer.component}'"
        return f"kernel {type(self.attend).__qualname__}"

    def supports_lse(self) -> bool:
        """Tell whether the kernel implements ``forward_with_lse`` (design §4.1's rule)."""
        if isinstance(self.attend, Attention):
            return registry.get(self.attend.backend_name).supports_lse()
        # The rule of AttentionBackend.supports_lse, applied to a kernel that may be unregistered.
        return type(self.attend).forward_with_lse is not AttentionImpl.forward_with_lse

    def forward(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        is_causal: bool,
    ) -> torch.Tensor:
        """Attend q to k and v; returns ``(B, Hq, Sq, D)``."""
        if isinstance(self.attend, Attention):
            out: torch.Tensor = self.attend(q, k, v, is_causal=is_causal)
            return out
        if is_causal:
            return self.attend.forward_causal(q, k, v, scale=self.scale)
        return self.attend.forward(q, k, v, scale=self.scale)

    def forward_varlen(
        self,
        q: torch.Tensor,  # (Tq, Hq, D)
        k: torch.Tensor,  # (Tk, Hk, D)
        v: torch.Tensor,  # (Tk, Hk, D)
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
    ) -> torch.Tensor:
        """Attend each packed query sequence to its own keys, non-causal: ``(Tq, Hq, D)``."""
        if isinstance(self.attend, Attention):
            return self.attend.forward_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
            )
        return self.attend.forward_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            is_causal=False,
            scale=self.scale,
        )

    def forward_with_lse(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend and return the output and the softmax LSE ``(B, Hq, Sq)``."""
        if isinstance(self.attend, Attention):
            return self.attend.forward_with_lse(q, k, v, is_causal=is_causal)
        return self.attend.forward_with_lse(q, k, v, is_causal=is_causal, scale=self.scale)
