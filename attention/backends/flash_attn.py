"""``flash_attn``: the flash-attn package's CUDA kernels, used only where that package imports.

It is never a dependency: the package is imported on first use, and the backend reports
itself unavailable (with the import error) wherever it does not import or there is no
CUDA device. The kernels take fp16/bf16 tensors and grouped-query K/V natively, and no
float bias (so no ``forward_biased``). Their
causal mask is aligned bottom-right where SDPA aligns it top-left, so causal attention
with fewer queries than keys (or the reverse) is refused rather than answered differently.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from attention.backend import AttentionBackend, AttentionImpl, DeviceKind

__all__ = ["FlashAttnBackend"]

# B batch, H heads, S seq, D head dim, T packed tokens


@functools.cache
def _import() -> ModuleType | str:
    """Return the flash_attn module, or why it cannot be imported."""
    try:
        return importlib.import_module("flash_attn")
    except ModuleNotFoundError:
        return "flash_attn is not installed"
    except Exception as err:  # a broken build raises anything from its extension module
        return f"flash_attn failed to import: {type(err).__name__}: {err}"


def _check_causal_alignment(is_causal: bool, same_lengths: bool) -> None:
    if is_causal and not same_lengths:
        raise ValueError(
            "flash_attn aligns causal masks bottom-right, the documented layout top-left; "
            "they differ when query and key lengths differ: use torch_flash for this layer"
        )


def _module() -> ModuleType:
    found = _import()
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


class FlashAttnImpl(AttentionImpl):
    """Call ``flash_attn_func`` / ``flash_attn_varlen_func``; they take ``(B, S, H, D)``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with the flash-attn kernel."""
        return _dense(q, k, v, is_causal=False, scale=scale)

    def forward_causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend causally with the kernel's causal mode (equal lengths only)."""
        return _dense(q, k, v, is_causal=True, scale=scale)

    def forward_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend and return the kernel's float32 LSE ``(B, Hq, Sq)``."""
        _check_causal_alignment(is_causal, q.shape[-2] == k.shape[-2])
        out, lse, _ = _module().flash_attn_func(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            softmax_scale=scale,
            causal=is_causal,
            return_attn_probs=True,
        )  # (B, Sq, Hq, D), (B, Hq, Sq)
        return out.transpose(1, 2), lse

    def forward_varlen(
        self,
        q: torch.Tensor,  # (Tq, Hq, D)
        k: torch.Tensor,  # (Tk, Hk, D)
        v: torch.Tensor,  # (Tk, Hk, D)
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend packed sequences with the varlen kernel (it wants int32 boundaries)."""
        _check_causal_alignment(is_causal, not is_causal or torch.equal(cu_seqlens_q, cu_seqlens_k))
        out: torch.Tensor = _module().flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q.to(torch.int32),
            cu_seqlens_k.to(torch.int32),
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=scale,
            causal=is_causal,
        )  # (Tq, Hq, D)
        return out


def _dense(
    q: torch.Tensor,  # (B, Hq, Sq, D)
    k: torch.Tensor,  # (B, Hk, Sk, D)
    v: torch.Tensor,  # (B, Hk, Sk, D)
    *,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    _check_causal_alignment(is_causal, q.shape[-2] == k.shape[-2])
    out: torch.Tensor = _module().flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        softmax_scale=scale,
        causal=is_causal,
    )  # (B, Sq, Hq, D)
    return out.transpose(1, 2)


class FlashAttnBackend(AttentionBackend):
    """Describe ``flash_attn``: CUDA only, and only where the package imports."""

    name = "flash_attn"
    impl_cls = FlashAttnImpl

    @classmethod
    def unavailable_reason(cls, kind: DeviceKind) -> str | None:
        """Say why flash_attn cannot run here: no CUDA device, or the package does not import."""
        if kind != "cuda":
            return f"flash_attn needs a CUDA device, this platform is {kind}"
        found = _import()
        return found if isinstance(found, str) else None
