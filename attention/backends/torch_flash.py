"""``torch_flash``: torch's fused flash kernel, which also returns the softmax log-sum-exp.

On CPU it is ``aten._scaled_dot_product_flash_attention_for_cpu`` (takes grouped-query
K/V and additive masks); on CUDA ``aten._scaled_dot_product_efficient_attention`` (any
float dtype, returns the LSE). Both are private ops: they are probed, not assumed by
torch version. No varlen kernel exists on CPU, so packed sequences run as a loop over
segments of the fused kernel, which spends no compute on padding. It takes no learned
bias: the flash kernel has no bias input (a float bias would take SDPA off the flash
path), so a site that adds one (T5) is refused rather than served by another kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from attention.backend import AttentionBackend, DeviceKind
from attention.backends.torch_sdpa import sdpa_masked
from attention.masks import additive_mask, as_4d
from attention.packing import PerSegmentVarlen

__all__ = ["TorchFlashBackend"]

# B batch, H heads, S seq, D head dim, T packed tokens

_CPU_OP = "_scaled_dot_product_flash_attention_for_cpu"
_CUDA_OP = "_scaled_dot_product_efficient_attention"


def _probe(name: str) -> Any:
    """Return ``torch.ops.aten.<name>``, or None where this torch build lacks it."""
    return getattr(torch.ops.aten, name, None)


_CPU_FLASH = _probe(_CPU_OP)
_CUDA_EFFICIENT = _probe(_CUDA_OP)


def _missing(op: str) -> str:
    return f"torch {torch.__version__} has no fused attention kernel aten.{op}"


class TorchFlashImpl(PerSegmentVarlen):
    """Call the fused kernel of the tensors' device; it returns the output and the LSE.

    Packed sequences run as one fused call per sequence (``PerSegmentVarlen``).
    """

    def forward(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with the fused kernel, dropping the LSE."""
        return self.forward_with_lse(q, k, v, is_causal=False, scale=scale)[0]

    def forward_causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend causally with the fused kernel's causal mode, dropping the LSE."""
        return self.forward_with_lse(q, k, v, is_causal=True, scale=scale)[0]

    def forward_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the output ``(B, Hq, Sq, D)`` and the float32 LSE ``(B, Hq, Sq)``."""
        if q.is_cuda:
            return _cuda_with_lse(q, k, v, is_causal=is_causal, scale=scale)
        if _CPU_FLASH is None:
            raise RuntimeError(_missing(_CPU_OP))
        out, lse = _CPU_FLASH(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse

    def forward_masked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor,  # bool or additive, broadcastable to (B, Hq, Sq, Sk)
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend under a mask; the kernel takes additive 4-D masks, so masks are converted.

        A fully masked query row yields zeros (the kernel reports its LSE as 0, not -inf).
        """
        if q.is_cuda:
            # SDPA picks the efficient kernel and aligns the bias the way that kernel needs.
            return sdpa_masked(q, k, v, attn_mask, scale=scale)
        if _CPU_FLASH is None:
            raise RuntimeError(_missing(_CPU_OP))
        bias = as_4d(additive_mask(attn_mask, q.dtype))
        result: tuple[torch.Tensor, torch.Tensor] = _CPU_FLASH(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
        return result[0]


def _cuda_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _CUDA_EFFICIENT is None:
        raise RuntimeError(_missing(_CUDA_OP))
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        # The efficient kernel wants as many K/V heads as query heads.
        k = k.repeat_interleave(groups, dim=-3)  # (B, Hq, Sk, D)
        v = v.repeat_interleave(groups, dim=-3)
    out, lse, _, _ = _CUDA_EFFICIENT(q, k, v, None, True, 0.0, is_causal, scale=scale)
    return out, lse[..., : q.shape[-2]]  # the kernel may pad the LSE's sequence dim


class TorchFlashBackend(AttentionBackend):
    """Describe ``torch_flash``: available where this torch build has the fused kernel."""

    name = "torch_flash"
    impl_cls = TorchFlashImpl

    @classmethod
    def unavailable_reason(cls, kind: DeviceKind) -> str | None:
        """Say which fused op this torch build lacks for ``kind``, or None."""
        op, found = (_CUDA_OP, _CUDA_EFFICIENT) if kind == "cuda" else (_CPU_OP, _CPU_FLASH)
        return None if found is not None else _missing(op)
