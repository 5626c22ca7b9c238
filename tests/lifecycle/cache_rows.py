"""What a test of step caches holds about a batch's rows: each one as it runs alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from components.batch import Batch


def assert_each_row_alone(run: Callable[[list[int]], Batch], flags: Sequence[bool]) -> None:
    """Run every row together, then each alone (``run(rows)`` denoises a batch of them),
    and hold each row's latents equal alone (1e-5), its cache present where its flag asks
    for one, with the same steps skipped, some of them."""
    together = run(list(range(len(flags))))
    for row, flag in enumerate(flags):
        alone = run([row])
        assert torch.allclose((alone.latents or [])[0], (together.latents or [])[row], atol=1e-5)
        ours, theirs = (together.cache_rows or [])[row], (alone.cache_rows or [])[0]
        assert (ours is None) == (theirs is None) == (not flag)
        if ours is not None and theirs is not None:
            assert ours.pattern == theirs.pattern
            assert ours.skipped > 0
