"""Which adapters, at what scale, apply to each row of the forward running now.

The orchestrator sets the rows of a stage's batch (``batch_rows``) around the kind's
run; an unmerged adapter's layers read them on every call (``AdapterRows.scale``).
Rows of one batch may name different adapters and scales: a layer then adds each
row's own low-rank delta, in the same forward.

To find a row, a layer reads the leading dimension of its input. Where it is a
multiple ``k x B`` of the batch's ``B`` rows, the rows follow the batch ``k`` times in
order (classifier-free guidance doubles a batch as [unconditional; conditional]),
which is how diffusers' and transformers' models lay out every linear layer's input.
A kind that packs requests otherwise says where its rows lie: ``request_tokens`` (each
packed token's request) or ``one_request`` (a pass over one request alone). Requests
of a forward map to the batch's rows the same way: request ``j`` is row ``j mod B``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from components.batch import Batch

Scale = float | torch.Tensor
"""One scale for every row, or one per row of a layer's input ``(R,)``."""


class AdapterRows:
    """The adapters and scales of each row of one batch, and where a forward's rows lie.

    Args:
        batch: the batch whose ``adapters`` name each row's adapters (read on every
            call: rows that leave the batch leave here too).
        tokens: each packed row's request in the forward, ``(T,)``; None when unpacked.
        only: the one request a pass runs, or None.
    """

    __slots__ = ("batch", "only", "tokens")

    def __init__(
        self, batch: Batch, tokens: torch.Tensor | None = None, only: int | None = None
    ) -> None:
        self.batch = batch
        self.tokens = tokens
        self.only = only

    def scale(self, name: str, leading: int) -> Scale | None:
        """Return the scale of adapter ``name`` for a layer input of ``leading`` rows.

        None when no row names it; one float when every row names it at the same scale.

        Raises:
            ValueError: rows differ, and ``leading`` is neither a multiple of the batch's
                rows nor the packed rows the kind declared: the rows cannot be found.
        """
        sets: Sequence[Mapping[str, float]] = self.batch.adapters or ()
        values = [row.get(name, 0.0) for row in sets]
        if not any(values):
            return None
        count = len(values)
        if self.only is not None:
            return values[self.only % count]
        if values.count(values[0]) == count:
            return values[0]
        per_row = torch.tensor(values)
        if self.tokens is not None and leading == self.tokens.shape[0]:
            return per_row[self.tokens.cpu() % count]
        if leading % count == 0:
            return per_row.repeat(leading // count)
        raise ValueError(
            f"adapter '{name}': a linear layer took {leading} rows from a batch of {count} "
            "whose rows name different adapters, and its component does not say which row "
            "is whose; batch such requests apart (serving does, for kinds that do not "
            "declare ComponentLoader.adapter_rows)"
        )


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


@contextmanager
def request_tokens(tokens: torch.Tensor) -> Iterator[None]:
    """Say that a layer input of ``len(tokens)`` rows packs requests: row ``i`` is ``tokens[i]``'s."""
    rows = ROWS.get()
    if rows is None or rows.only is not None:
        yield  # no adapters apply, or one request runs alone: nothing to tell
        return
    token = ROWS.set(AdapterRows(rows.batch, tokens=tokens))
    try:
        yield
    finally:
        ROWS.reset(token)


@contextmanager
def one_request(index: int) -> Iterator[None]:
    """Say that the body runs request ``index`` of the forward alone."""
    rows = ROWS.get()
    if rows is None or rows.only is not None:
        yield
        return
    token = ROWS.set(AdapterRows(rows.batch, only=index))
    try:
        yield
    finally:
        ROWS.reset(token)
