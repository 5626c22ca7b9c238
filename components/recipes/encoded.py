"""What a recipe's encode stage writes of each row, taken apart from the batch and put back.

Every recipe's encode stage writes per-row fields only (``TEXT_FIELDS``): one row's
values depend on its prompt, its negative prompt where the class encodes one, the
encoders and the class's template and lengths, never on the other rows (each text is
encoded on its own tokens; padding is masked or dropped). So a row's values can be kept
apart and put back into another batch, as the stage would have written them there: the
entries of a prompt cache (``lifecycle.prompts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from components.batch import Batch

__all__ = ["EncodedRow", "encoded_rows", "restore_rows"]

LISTED = ("context", "negative_context")
"""Fields that hold one tensor per row (a row's own length)."""
STACKED = ("context_mask", "negative_context_mask", "pooled", "negative_pooled")
"""Fields that hold one tensor for every row, a row along the first axis."""


class EncodedRow(NamedTuple):
    """One row's text, as the encode stage wrote it, on the host.

    Attributes:
        tensors: each field the stage wrote, by name, with the row's tensor.
        truncated: whether an encoder cut the row's prompt.
    """

    tensors: dict[str, torch.Tensor]
    truncated: bool

    @property
    def bytes(self) -> int:
        """Return the bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def encoded_rows(batch: Batch) -> list[EncodedRow]:
    """Return each row's text of ``batch`` after its encode stage, copied to the host."""
    rows = []
    for row in range(batch.size):
        tensors = {}
        for name in LISTED:
            listed: list[torch.Tensor] | None = getattr(batch, name)
            if listed is not None:
                tensors[name] = listed[row].to("cpu", copy=True)
        for name in STACKED:
            stacked: torch.Tensor | None = getattr(batch, name)
            if stacked is not None:
                tensors[name] = stacked[row].to("cpu", copy=True)
        truncated = batch.truncated is not None and batch.truncated[row]
        rows.append(EncodedRow(tensors, truncated))
    return rows


def restore_rows(batch: Batch, rows: Sequence[EncodedRow]) -> None:
    """Write ``rows`` (one per row of ``batch``, alike in their fields) into ``batch``, as
    its encode stage would have written them."""
    fields = rows[0].tensors.keys()
    for name in LISTED:
        if name in fields:
            setattr(batch, name, [row.tensors[name] for row in rows])
    for name in STACKED:
        if name in fields:
            setattr(batch, name, torch.stack([row.tensors[name] for row in rows]))
    batch.mark_truncated([row.truncated for row in rows])
