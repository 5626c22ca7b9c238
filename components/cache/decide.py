"""The pure decisions of a step cache: compute a step or skip it, and what a skip reuses.

Nothing here holds state or touches a module: ``components.cache.state`` keeps what a
row carries between steps and ``components.cache.stack`` runs a block stack by these
decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from components.cache.settings import CacheSettings

__all__ = [
    "exceeds",
    "l1_parts",
    "must_compute",
    "on_interval",
    "relative_change",
    "taylor_predict",
    "taylor_update",
]

# n rows, E width


def must_compute(
    settings: CacheSettings, step: int, steps: int, skipped_in_a_row: int, primed: bool
) -> bool:
    """Tell whether ``step`` (0-based, of ``steps``) is computed whatever the cache measures.

    That is a request too short to skip any step, a warm-up or final step, the step
    after ``max_skipped`` skips in a row, and any step before the row has something
    to reuse (``primed``).
    """
    bound = settings.max_skipped_value
    return (
        not settings.skips_in(steps)
        or step < settings.warmup_steps
        or step >= steps - settings.final_steps
        or not primed
        or (bound is not None and skipped_in_a_row >= bound)
    )


def on_interval(settings: CacheSettings, step: int) -> bool:
    """Tell whether taylor_seer computes ``step`` fully: every ``interval``-th after warm-up.

    With a warm-up of ``w`` and an interval of ``k``, steps ``w + k - 1``, ``w + 2k - 1``,
    ... are computed, and the ``k - 1`` before each are predicted.
    """
    interval = settings.interval_value
    return (step - settings.warmup_steps) % interval == interval - 1


def exceeds(settings: CacheSettings, change: float) -> bool:
    """Tell whether first_block's measured ``change`` is too large to skip the step."""
    return not change < settings.threshold_value  # a NaN change computes


def l1_parts(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Return ``[sum |now - before|, sum |before|]`` in float64 (a relative L1's two sums).

    Sums, not means, so the parts of one row held on several ranks, or of its guidance
    branches, add up before the ratio is taken.
    """
    before64 = before.double()
    return torch.stack([(now.double() - before64).abs().sum(), before64.abs().sum()])


def relative_change(parts: torch.Tensor) -> float:
    """Return the relative L1 change ``sum |now - before| / sum |before|`` from its parts."""
    difference, size = parts.tolist()
    return math.inf if size == 0 else float(difference / size)


def taylor_update(
    factors: Sequence[torch.Tensor], value: torch.Tensor, distance: int, order: int
) -> list[torch.Tensor]:
    """Return the Taylor factors after ``value`` was computed ``distance`` steps after the last.

    Factor ``j`` is the ``j``-th divided difference of the computed values over the step
    index (the ``j``-th derivative's estimate); a first value, or a ``distance`` of 0,
    keeps only the value itself. As diffusers' ``TaylorSeerState.update``.
    """
    updated = [value]
    if distance <= 0:
        return updated
    for j in range(min(order, len(factors))):
        updated.append((updated[j] - factors[j]) / distance)
    return updated


def taylor_predict(factors: Sequence[torch.Tensor], distance: int) -> torch.Tensor:
    """Return the value ``distance`` steps after the last computed one, from its factors."""
    out = factors[0].clone()
    for j in range(1, len(factors)):
        out.add_(factors[j], alpha=distance**j / math.factorial(j))
    return out
