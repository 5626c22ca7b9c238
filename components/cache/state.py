"""What a step cache keeps for one row between steps, and what one forward is handed.

A row (one image of a request) owns a ``RowCache`` for its denoising stage: the tensors
it reuses and how many of its steps were computed or skipped. It lives in the batch
(``Batch.cache_rows``), leaves with the row when its request is cancelled, and drops its
tensors when the stage ends (``release``). A forward of the block stack gets a
``StepCache``: the step, and each of its rows' cache and guidance branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from components.cache.settings import CacheSettings

if TYPE_CHECKING:
    from components.batch import Batch

__all__ = [
    "BranchCache",
    "CacheSteps",
    "RowCache",
    "StepCache",
    "any_cached",
    "count_steps",
    "release_caches",
    "start_rows",
    "step_rows",
]

# n rows, E width


@dataclass
class BranchCache:
    """What one guidance branch of a row keeps between steps (its rows on this rank).

    Attributes:
        head: first_block: the first block's output residual at the last computed step.
        tail: first_block: the other blocks' output residual at the last computed step.
        factors: taylor_seer: the Taylor factors of the stack's output residual.
    """

    head: torch.Tensor | None = None
    tail: torch.Tensor | None = None
    factors: list[torch.Tensor] = field(default_factory=list)


class RowCache:
    """One row's step cache over one denoising stage.

    Args:
        settings: the component's cache.
        steps: the stage's steps.

    Attributes:
        uncached: why the row runs every step uncached (too few steps to skip any), or None.
        decisions: each step's decision so far: computed (True) or skipped.
        in_a_row: the steps skipped since the last computed one.
        last_computed: the last step computed (None before the first).
        branches: what each guidance branch keeps, by branch.
    """

    def __init__(self, settings: CacheSettings, steps: int) -> None:
        self.settings = settings
        self.steps = steps
        self.uncached = settings.uncached_reason(steps)
        self.decisions: list[bool] = []
        self.in_a_row = 0
        self.last_computed: int | None = None
        self.branches: dict[int, BranchCache] = {}

    @property
    def computed(self) -> int:
        """Return the steps computed so far."""
        return sum(self.decisions)

    @property
    def skipped(self) -> int:
        """Return the steps skipped so far."""
        return len(self.decisions) - self.computed

    @property
    def pattern(self) -> str:
        """Return the decisions as text, a letter a step: ``C`` computed, ``S`` skipped."""
        return "".join("C" if computed else "S" for computed in self.decisions)

    def branch(self, index: int) -> BranchCache:
        """Return what branch ``index`` keeps (empty the first time)."""
        return self.branches.setdefault(index, BranchCache())

    def count(self, step: int, *, computed: bool) -> None:
        """Record ``step``'s decision: computed or skipped."""
        self.decisions.append(computed)
        if computed:
            self.in_a_row = 0
            self.last_computed = step
        else:
            self.in_a_row += 1

    def release(self) -> None:
        """Drop every tensor kept (the stage ended); the counts stay."""
        self.branches.clear()


@dataclass(frozen=True)
class StepCache:
    """What one forward of a block stack is told about its rows' caches.

    Attributes:
        step: the step being run (0-based).
        steps: the stage's steps.
        rows: per row of the forward, in order: its cache (None: computed every step,
            uncounted) and its guidance branch.
        group: the ranks holding the other parts of the same rows (the other guidance
            branch under CFG parallel): their measured changes add up before deciding,
            so every rank decides alike. None: this rank holds whole rows.
    """

    step: int
    steps: int
    rows: Sequence[tuple[RowCache | None, int]]
    group: dist.ProcessGroup | None = None


def step_rows(
    caches: Sequence[RowCache | None], branches: int
) -> list[tuple[RowCache | None, int]]:
    """Return the rows of a forward over ``branches`` guidance branches of ``caches``' rows.

    The branches come one after another (``torch.cat([latents] * 2)``): branch ``b`` of
    row ``i`` is forward row ``b * len(caches) + i``.
    """
    return [(cache, branch) for branch in range(branches) for cache in caches]


def start_rows(
    settings: CacheSettings, wanted: Sequence[bool], steps: int
) -> list[RowCache | None]:
    """Return a fresh cache for each row that wants one (None for the others) over ``steps``."""
    return [RowCache(settings, steps) if want else None for want in wanted]


def release_caches(batch: Batch) -> None:
    """Drop the tensors every row of ``batch`` keeps for its cache (its stage ended)."""
    for row in batch.cache_rows or ():
        if row is not None:
            row.release()


class CacheSteps(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Steps a step cache computed and skipped, summed over rows (image steps).

    Attributes:
        computed: steps computed (warm-up, final and uncached steps included).
        skipped: steps skipped.
        uncached: rows that ran every step uncached: their request had too few steps for
            the cache to skip any.
    """

    computed: int = 0
    skipped: int = 0
    uncached: int = 0

    def __add__(self, other: CacheSteps) -> CacheSteps:
        return CacheSteps(
            computed=self.computed + other.computed,
            skipped=self.skipped + other.skipped,
            uncached=self.uncached + other.uncached,
        )


def count_steps(rows: Sequence[RowCache | None]) -> CacheSteps:
    """Return the steps ``rows`` computed and skipped (rows without a cache count none)."""
    cached = [row for row in rows if row is not None]
    return CacheSteps(
        computed=sum(row.computed for row in cached),
        skipped=sum(row.skipped for row in cached),
        uncached=sum(row.uncached is not None for row in cached),
    )


def any_cached(rows: Sequence[RowCache | None] | None) -> bool:
    """Tell whether any of ``rows`` runs a cache (a forward of none computes as uncached)."""
    return rows is not None and any(row is not None for row in rows)
