"""Parameter counts of the layers the reference kinds are made of.

A kind declares its size from its options with these, so admission can check
the memory budget without building anything; a test holds each declaration to
the module actually built.
"""

from __future__ import annotations


def linear(inputs: int, outputs: int) -> int:
    """Count an ``nn.Linear`` with bias."""
    return inputs * outputs + outputs


def conv3x3(inputs: int, outputs: int) -> int:
    """Count a 3x3 ``nn.Conv2d`` with bias."""
    return 9 * inputs * outputs + outputs


def norm(width: int) -> int:
    """Count an affine ``nn.LayerNorm`` or ``nn.GroupNorm``."""
    return 2 * width


def attention_projections(dim: int, kdim: int) -> int:
    """Count ``MultiheadProjections`` (as ``nn.MultiheadAttention``): q, k, v, bias, out."""
    return dim * dim + 2 * dim * kdim + 3 * dim + linear(dim, dim)
