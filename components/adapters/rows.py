"""Which adapters, at what scale, apply to each row of the forward running now.

The orchestrator sets the rows of a stage's batch (``batch_rows``) around the kind's
run; an unmerged adapter's layers read them on every call (``AdapterRows.scale``).
Rows of one batch may name different adapters and scales: a layer then adds each
row's own low-rank delta, in the same forward.

To find a row, a layer reads the leading dimension of its input: a multiple
``k x B`` of the batch's ``B`` rows holds them ``k`` times in order (classifier-free
guidance doubles a batch as [unconditional; conditional]). That is how diffusers'
models lay out every linear layer's input; a kind says so with
``ComponentLoader.adapter_rows``, and rows naming different sets run in one forward
only there (a kind that packs rows into one sequence would be misread).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from components.batch import Batch

__all__ = ["ROWS", "AdapterRows", "batch_rows"]

Scale = float | torch.Tensor
"""One scale for every row, or one per row of a layer's input ``(R,)``."""


class AdapterRows:
    """The adapters and scales of each row of one batch.

    Args:
        batch: the batch whose ``adapters`` name each row's adapters (read on every
            call: rows that leave the batch leave here too).
    """

    __slots__ = ("batch",)

    def __init__(self, batch: Batch) -> None:
        self.batch = batch

    def scale(self, name: str, leading: int) -> Scale | None:
        """Return the scale of adapter ``name`` for a layer input of ``leading`` rows.

        None when no row names it; one float when every row names it at the same scale.

        Raises:
            ValueError: rows differ and ``leading`` is not a multiple of the batch's
                rows: the rows cannot be found.
        """
        sets: Sequence[Mapping[str, float]] = self.batch.adapters or ()
        values = [row.get(name, 0.0) for row in sets]
        if not any(values):
            return None
        count = len(values)
        if values.count(values[0]) == count:
            return values[0]
        if leading % count:
            raise ValueError(
                f"adapter '{name}': a linear layer took {leading} rows from a batch of "
                f"{count} whose rows name different adapters; batch such requests apart"
            )
        return torch.tensor(values).repeat(leading // count)


ROWS: ContextVar[AdapterRows | None] = ContextVar("adapter_rows", default=None)
"""The rows of the forward running on this thread; None: no adapter applies."""


@contextmanager
def batch_rows(batch: Batch) -> Iterator[None]:
    """Let unmerged adapters read ``batch``'s rows while the body runs its components."""
    token = ROWS.set(AdapterRows(batch) if batch.adapters else None)
    try:
        yield
    finally:
        ROWS.reset(token)
