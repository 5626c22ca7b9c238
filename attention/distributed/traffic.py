"""Count the bytes each rank sends in the distributed attention variants (for benchmarks).

A ContextVar scope, not process-global state: ``with count_traffic() as traffic:`` collects
what the collectives started inside it send from this rank, by kind of collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

__all__ = ["Traffic", "count_traffic", "record"]


@dataclass
class Traffic:
    """Bytes this rank sent, by collective (``all_to_all``, ``ring``, ``all_gather``, ...)."""

    sent: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Return every byte sent."""
        return sum(self.sent.values())


_current: ContextVar[Traffic | None] = ContextVar("attention_traffic", default=None)


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count what this rank sends while the block runs."""
    traffic = Traffic()
    token = _current.set(traffic)
    try:
        yield traffic
    finally:
        _current.reset(token)


def record(kind: str, tensor: torch.Tensor, share: float = 1.0) -> None:
    """Add ``share`` of ``tensor``'s bytes to the ``kind`` count (no-op outside a scope).

    ``share`` is the part that leaves the rank: an all-to-all keeps its own block.
    """
    traffic = _current.get()
    if traffic is not None:
        sent = round(tensor.numel() * tensor.element_size() * share)
        traffic.sent[kind] = traffic.sent.get(kind, 0) + sent
