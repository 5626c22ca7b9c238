"""What layerwise settings a block stack can honour: one check for admission and the store."""

from __future__ import annotations

__all__ = ["layerwise_problems"]


def layerwise_problems(blocks: int, *, prefetch: int, resident_layers: int) -> list[str]:
    """Say which layerwise setting a stack of ``blocks`` blocks cannot honour, if any.

    Admission calls this with the block count a kind declares from its options, and
    ``LayerwiseStore`` with the stack it was handed, so the two never disagree.
    """
    problems = []
    if prefetch < 0:
        problems.append(f"prefetch is {prefetch}; use 0 or more blocks")
    if not 0 <= resident_layers <= blocks:
        problems.append(f"resident_layers is {resident_layers}; use 0 to {blocks}")
    return problems
