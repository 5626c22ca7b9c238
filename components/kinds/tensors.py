"""The tensors the reference kinds' modules hold, named and shaped, from their options.

A kind declares them so ``check`` can hold a weights file's header to them without
building anything; a test holds each declaration to the state dict of every path the
kind builds.
"""

from __future__ import annotations

from components.weights import DeclaredTensor, DeclaredTensors

__all__ = ["attention_projections", "conv3x3", "embedding", "linear", "norm"]


def linear(prefix: str, inputs: int, outputs: int) -> DeclaredTensors:
    """Declare an ``nn.Linear`` with bias."""
    return {
        f"{prefix}.weight": DeclaredTensor((outputs, inputs)),
        f"{prefix}.bias": DeclaredTensor((outputs,)),
    }


def conv3x3(prefix: str, inputs: int, outputs: int) -> DeclaredTensors:
    """Declare a 3x3 ``nn.Conv2d`` with bias."""
    return {
        f"{prefix}.weight": DeclaredTensor((outputs, inputs, 3, 3)),
        f"{prefix}.bias": DeclaredTensor((outputs,)),
    }


def norm(prefix: str, width: int) -> DeclaredTensors:
    """Declare an affine ``nn.LayerNorm`` or ``nn.GroupNorm``."""
    return {
        f"{prefix}.weight": DeclaredTensor((width,)),
        f"{prefix}.bias": DeclaredTensor((width,)),
    }


def embedding(prefix: str, count: int, width: int) -> DeclaredTensors:
    """Declare an ``nn.Embedding``."""
    return {f"{prefix}.weight": DeclaredTensor((count, width))}


def attention_projections(prefix: str, dim: int, kdim: int) -> DeclaredTensors:
    """Declare ``MultiheadProjections`` as ``nn.MultiheadAttention`` names them.

    One packed input projection when keys are as wide as queries, else three.
    """
    packed = (
        {f"{prefix}.in_proj_weight": DeclaredTensor((3 * dim, dim))}
        if kdim == dim
        else {
            f"{prefix}.q_proj_weight": DeclaredTensor((dim, dim)),
            f"{prefix}.k_proj_weight": DeclaredTensor((dim, kdim)),
            f"{prefix}.v_proj_weight": DeclaredTensor((dim, kdim)),
        }
    )
    return {
        **packed,
        f"{prefix}.in_proj_bias": DeclaredTensor((3 * dim,)),
        **linear(f"{prefix}.out_proj", dim, dim),
    }
