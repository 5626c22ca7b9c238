"""Run a block stack under a step cache: each row decides for itself, in one packed forward.

A DiT hands its rows (every request of the forward, whole) to ``run_cached`` as a state
it knows how to run part of its stack on (``CachedStack``). Per row:

- ``first_block`` runs the first block on every row, measures each row's change against
  its last computed step, and runs the other blocks only on the rows above the
  threshold: the others leave the packed sequence and add the residual they kept;
- ``taylor_seer`` runs the whole stack only on the rows due a full step; the others
  leave before the first block and add the residual their Taylor factors predict.

A row's decision reads only its own rows (the parts of its guidance branches summed,
across ranks where they lie apart), so it equals the row's decision run alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from components.cache.decide import (
    exceeds,
    l1_parts,
    must_compute,
    on_interval,
    relative_change,
    taylor_predict,
    taylor_update,
)
from components.cache.state import BranchCache, RowCache, StepCache

__all__ = ["CachedStack", "run_cached"]

# n_i image rows of row i, E width

State = TypeVar("State")


class CachedStack(Protocol[State]):
    """A block stack a step cache can run in parts, on any subset of a forward's rows.

    ``State`` holds every row's tensors whole (on every rank) in row order; what the
    stack adds to the image rows is what a cache keeps and reuses.
    """

    def depth(self) -> int:
        """Return the blocks of the stack."""
        ...

    def run_blocks(self, state: State, start: int, stop: int) -> State:
        """Run blocks ``start`` to ``stop`` (exclusive) on every row of ``state``; a new state
        (``state`` itself is left as it was)."""
        ...

    def select(self, state: State, rows: Sequence[int]) -> State:
        """Return the state of rows ``rows`` alone (their own positions, text, conditions)."""
        ...

    def images(self, state: State) -> list[torch.Tensor]:
        """Return each row's image rows ``(n_i, E)``."""
        ...

    def with_images(self, state: State, images: Sequence[torch.Tensor]) -> State:
        """Return ``state`` with each row's image rows replaced by ``images``."""
        ...


def run_cached(stack: CachedStack[State], state: State, cache: StepCache) -> State:
    """Run ``stack`` on ``state`` as ``cache`` decides, row by row; the state after it.

    Rows without a cache compute every block. Each row with one is counted once per step.
    """
    rows = cache.rows
    method = next((c.settings.method for c, _ in rows if c is not None), None)
    if method == "first_block":
        return _first_block(stack, state, cache)
    if method == "taylor_seer":
        return _taylor_seer(stack, state, cache)
    return stack.run_blocks(state, 0, stack.depth())


def _first_block(stack: CachedStack[State], state: State, cache: StepCache) -> State:
    before = stack.images(state)
    head = stack.run_blocks(state, 0, 1)
    residuals = [a - b for a, b in zip(stack.images(head), before, strict=True)]
    compute = _decide_first_block(cache, residuals)

    def keep(i: int, row: RowCache, kept: BranchCache, tail: torch.Tensor) -> None:
        kept.head, kept.tail = residuals[i], tail

    def reuse(row: RowCache, kept: BranchCache) -> torch.Tensor:
        assert kept.tail is not None  # primed
        return kept.tail

    return _resume(stack, head, cache, compute, 1, keep, reuse)


def _decide_first_block(cache: StepCache, residuals: Sequence[torch.Tensor]) -> list[bool]:
    """Decide every row of the forward: compute (True) or skip; count each cached row once."""
    units = _units(cache)
    primed = {
        key: all(
            cached.branch(b).head is not None
            for c, b in cache.rows
            if c is not None and id(c) == key
        )
        for key, cached in units.items()
    }
    measured = [
        key
        for key, cached in units.items()
        if not must_compute(cached.settings, cache.step, cache.steps, cached.in_a_row, primed[key])
    ]
    changes = _changes(cache, residuals, measured)
    verdict = {
        key: key not in changes or exceeds(cached.settings, changes[key])
        for key, cached in units.items()
    }
    return _count(cache, units, verdict)


def _changes(
    cache: StepCache, residuals: Sequence[torch.Tensor], measured: Sequence[int]
) -> dict[int, float]:
    """Return the relative L1 change of each row in ``measured`` (its branches together).

    Under a ``group`` every rank sums its parts with the others' first: the ranks must
    measure the same rows (they do: the group runs one batch in lockstep).
    """
    if not measured:
        return {}
    position = {key: i for i, key in enumerate(measured)}
    parts = torch.zeros(len(measured), 2, dtype=torch.float64)
    for residual, (row, branch) in zip(residuals, cache.rows, strict=True):
        if row is None or id(row) not in position:
            continue
        head = row.branch(branch).head
        assert head is not None  # measured rows are primed
        parts[position[id(row)]] += l1_parts(residual, head).cpu()
    if cache.group is not None:
        dist.all_reduce(parts, group=cache.group)
    return {key: relative_change(parts[i]) for key, i in position.items()}


def _taylor_seer(stack: CachedStack[State], state: State, cache: StepCache) -> State:
    units = _units(cache)
    verdict = {
        key: must_compute(
            cached.settings,
            cache.step,
            cache.steps,
            cached.in_a_row,
            cached.last_computed is not None,
        )
        or on_interval(cached.settings, cache.step)
        for key, cached in units.items()
    }
    last = {key: cached.last_computed for key, cached in units.items()}
    compute = _count(cache, units, verdict)

    def keep(i: int, row: RowCache, kept: BranchCache, residual: torch.Tensor) -> None:
        previous = last[id(row)]
        distance = 0 if previous is None else cache.step - previous
        kept.factors = taylor_update(kept.factors, residual, distance, row.settings.order_value)

    def reuse(row: RowCache, kept: BranchCache) -> torch.Tensor:
        previous = last[id(row)]
        assert previous is not None  # primed
        return taylor_predict(kept.factors, cache.step - previous)

    return _resume(stack, state, cache, compute, 0, keep, reuse)


Keep: TypeAlias = Callable[[int, RowCache, BranchCache, torch.Tensor], None]
"""Keeps what a computed forward row ``i`` (its cache, its branch's state) needs later, from
the residual its blocks added to its image rows."""
Reuse: TypeAlias = Callable[[RowCache, BranchCache], torch.Tensor]
"""Returns the residual a skipped row adds to its image rows instead of running the blocks."""


def _resume(
    stack: CachedStack[State],
    state: State,
    cache: StepCache,
    compute: Sequence[bool],
    start: int,
    keep: Keep,
    reuse: Reuse,
) -> State:
    """Run the stack from block ``start`` on the rows that compute, packed together; the
    others add the residual they reuse. Returns the state with every row's image rows."""
    before = stack.images(state)
    done = _run_rows(stack, state, [i for i, yes in enumerate(compute) if yes], start)
    images = []
    for i, (row, branch) in enumerate(cache.rows):
        if compute[i]:
            out = next(done)
            if row is not None:
                keep(i, row, row.branch(branch), out - before[i])
        else:
            assert row is not None  # rows without a cache always compute
            out = before[i] + reuse(row, row.branch(branch))
        images.append(out)
    return stack.with_images(state, images)


def _run_rows(
    stack: CachedStack[State], state: State, rows: Sequence[int], start: int
) -> Iterator[torch.Tensor]:
    """Run the stack from block ``start`` on ``rows`` alone, packed together; yield each
    one's image rows after it, in order."""
    if not rows:
        return iter(())
    return iter(stack.images(stack.run_blocks(stack.select(state, rows), start, stack.depth())))


def _units(cache: StepCache) -> dict[int, RowCache]:
    """Return each distinct row cache of the forward by identity (a row's branches share one)."""
    return {id(row): row for row, _ in cache.rows if row is not None}


def _count(cache: StepCache, units: dict[int, RowCache], verdict: dict[int, bool]) -> list[bool]:
    """Count each row cache's step once, and return the verdict of every forward row."""
    for key, row in units.items():
        row.count(cache.step, computed=verdict[key])
    return [row is None or verdict[id(row)] for row, _ in cache.rows]
