"""Convert attention masks between the boolean and additive forms kernels accept."""

from __future__ import annotations

import torch

__all__ = ["additive_mask", "as_4d", "causal_mask"]

# Sq query positions, Sk key positions


def causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Return the ``(Sq, Sk)`` boolean mask that lets query ``i`` see keys ``j <= i``."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean mask (True takes part) into 0 / -inf of ``dtype``; cast an additive one."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf")
        )
    return mask.to(dtype)


def as_4d(mask: torch.Tensor) -> torch.Tensor:
    """View a mask of fewer dims as 4-D with leading singletons; CPU fused kernels want 2-D/4-D."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
