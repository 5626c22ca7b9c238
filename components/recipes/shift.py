"""The resolution-dependent shift of flow-matching schedules (Flux, SD3 with dynamic shifting).

Larger images keep more noise for longer: the schedule's ``mu`` grows linearly with the
image's token count, from ``base_shift`` at ``base_image_seq_len`` tokens to
``max_shift`` at ``max_image_seq_len``, each read from the scheduler's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["flow_shift"]


def flow_shift(config: Mapping[str, Any], tokens: int, max_shift: float) -> float:
    """Return ``mu`` for an image of ``tokens`` tokens; ``max_shift`` where the config has none.

    Computed in the order diffusers computes it, so the float is the same.
    """
    base_tokens = config.get("base_image_seq_len", 256)
    max_tokens = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    slope = (config.get("max_shift", max_shift) - base_shift) / (max_tokens - base_tokens)
    intercept = base_shift - slope * base_tokens
    return float(tokens * slope + intercept)
