"""Helpers for tests of code that uses attention: tolerances, inputs, FLOPs, a plain kernel."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from attention.backend import AttentionImpl
from attention.request import BackendChoice
from attention.roles import Provenance

__all__ = [
    "TOLERANCE",
    "RandomInputs",
    "SdpaImpl",
    "automatic",
    "count_attention_flops",
    "explicit",
    "rel_err",
    "run_dense",
]

# B batch, H heads, S seq, D head dim

# Largest allowed max|out - ref| / max|ref| against the float64 reference, per input dtype:
# about three times the worst seen over many seeds (1e-15, 7e-7, 5e-4, 4e-3).
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.float16: 1.5e-3,
    torch.bfloat16: 1.2e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Return max|out - ref| / max|ref|, computed in float64."""
    diff = (out.double() - ref.double()).abs().max()
    return float(diff / ref.double().abs().max())


def explicit(name: str) -> BackendChoice:
    """Return a backend the user or the code named."""
    return BackendChoice(name=name, provenance=Provenance.EXPLICIT)


def automatic(name: str) -> BackendChoice:
    """Return a backend the framework derived."""
    return BackendChoice(name=name, provenance=Provenance.AUTOMATIC)


def run_dense(
    kernel: AttentionImpl,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Call ``kernel``'s causal entry when ``causal``, else its plain ``forward``."""
    if causal:
        return kernel.forward_causal(q, k, v, scale=scale)
    return kernel.forward(q, k, v, scale=scale)


class SdpaImpl(AttentionImpl):
    """A minimal out-of-tree kernel: ``forward`` through SDPA and no other capability.

    A test subclasses it to grant one capability at a time, since a backend's
    capabilities are what its implementation overrides.
    """

    def forward(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend with SDPA."""
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=scale
        )  # (B, Hq, Sq, D)


def count_attention_flops() -> FlopCounterMode:
    """Return a FLOP counter that also counts torch's fused CPU attention op.

    torch's own counter knows the CUDA attention ops only; this adds the CPU one with the
    same formula: two matmuls, ``q @ k^T`` and ``p @ v``, at 2 FLOPs a multiply-add.
    """

    def formula(
        q: torch.Size, k: torch.Size, v: torch.Size, *_: Any, out_shape: Any = None, **__: Any
    ) -> int:
        b, hq, sq, d = q  # K/V heads broadcast to Hq under grouped-query attention
        return 2 * b * hq * sq * k[-2] * (d + v[-1])

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return FlopCounterMode(display=False, custom_mapping={op: formula})


class RandomInputs:
    """Draw fresh random (never zero) attention inputs from one seed, quoted on failure.

    Args:
        seed: the generator's seed.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def tensor(self, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Return a standard normal tensor of ``shape``, drawn in float64 and cast."""
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64).to(dtype)

    def qkv(
        self, b: int, hq: int, hk: int, sq: int, sk: int, d: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return dense q ``(B, Hq, Sq, D)``, k and v ``(B, Hk, Sk, D)``."""
        return (
            self.tensor(b, hq, sq, d, dtype=dtype),
            self.tensor(b, hk, sk, d, dtype=dtype),
            self.tensor(b, hk, sk, d, dtype=dtype),
        )

    def keep_mask(self, *shape: int) -> torch.Tensor:
        """Return a boolean mask, about a third masked out, every row keeping key 0."""
        keep = torch.rand(*shape, generator=self.generator) > 0.33
        keep[..., 0] = True
        return keep
