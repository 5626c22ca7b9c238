"""The prompt-embedding cache: encoded prompts kept on the host (design §19).

A pipeline from a folder with ``serving.prompt_cache_bytes`` keeps what its encode stage
wrote of each row (``components.recipes.encoded``). A batch whose rows are all kept
takes its text from here and never enters the encode stage: its text encoders are not
used, so nothing onloads them, no budget counts them and no prefetch moves them. The
request knows this before the stage, from the keys alone.

A row's key is everything its text depends on:
- the encoders: each encode-stage component's identity (kind, options, admitted build
  and dtype: ``lifecycle.device.sharing``) with the xxh3 checksum of every tensor of its
  weight files, taken once, at the first request that asks;
- the class, the templated prompt and negative prompt, and whether a negative branch
  is encoded (``Recipe.prompt_keys``);
- the adapters the row runs on an encode-stage component, with their scales and specs.

Entries leave least recently used first once their bytes pass the bound; a row larger
than the whole bound is never kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence

import msgspec
import xxhash

from components.batch import Batch
from components.folders.loader import FolderLoader
from components.recipes import Recipe
from components.recipes.encoded import EncodedRow, encoded_rows, restore_rows
from components.weights import tensor_checksums
from lifecycle.adapters import AdapterKeeper
from lifecycle.device.sharing import component_identity
from lifecycle.device.slots import ComponentSlot
from lifecycle.events import PromptCounts
from lifecycle.spec.structs import PipelineSpec

__all__ = ["PromptCache", "counted", "encoders_checksum"]


class PromptCache:
    """Encoded rows of one pipeline's encode stage, by key, within ``capacity`` bytes.

    Args:
        capacity: the most bytes its entries hold together.
        stage: the name of the stage it stands in for.
        uses: that stage's components.
        encoders: returns the checksum of those components (called once, when first
            needed).
    """

    def __init__(
        self, capacity: int, stage: str, uses: Sequence[str], encoders: Callable[[], int]
    ) -> None:
        self.capacity = capacity
        self.stage = stage
        self.uses = tuple(uses)
        self._encoders = encoders
        self._checksum: int | None = None
        self._entries: OrderedDict[Hashable, EncodedRow] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        """The bytes its entries hold now."""

    def keys(self, recipe: Recipe, batch: Batch, adapters: AdapterKeeper) -> dict[int, Hashable]:
        """Return each row's key, by the row's original index (``batch.rows``).

        Raises:
            ValueError: the recipe refuses the batch (``Recipe.check``).
        """
        if self._checksum is None:
            self._checksum = self._encoders()
        prompts = recipe.prompt_keys(batch)
        rows = batch.adapters or [{}] * batch.size
        return {
            row: (self._checksum, prompt, self._adapters_of(named, adapters))
            for row, prompt, named in zip(batch.rows, prompts, rows, strict=True)
        }

    def _adapters_of(self, named: Mapping[str, float], adapters: AdapterKeeper) -> Hashable:
        """Return the adapters of ``named`` that change an encode-stage component, with their
        scales and specs, in name order."""
        return tuple(
            (name, scale, msgspec.json.encode(adapters.adapters[name].spec))
            for name, scale in sorted(named.items())
            if adapters.adapters[name].component in self.uses
        )

    def restore(self, keys: Mapping[int, Hashable], batch: Batch) -> bool:
        """Write every row's kept text into ``batch`` and return True, or (a row is not
        kept) write nothing and return False."""
        with self._lock:
            found = [self._entries.get(keys[row]) for row in batch.rows]
            kept = [entry for entry in found if entry is not None]
            if len(kept) < len(found):
                return False
            for row in batch.rows:
                self._entries.move_to_end(keys[row])
        restore_rows(batch, kept)
        return True

    def keep(self, keys: Mapping[int, Hashable], batch: Batch) -> None:
        """Keep each row's text of ``batch``, after its encode stage, making room by dropping
        the least recently used entries."""
        encoded = encoded_rows(batch)
        with self._lock:
            for row, entry in zip(batch.rows, encoded, strict=True):
                key = keys[row]
                if key in self._entries or entry.bytes > self.capacity:
                    continue
                while self.bytes + entry.bytes > self.capacity:
                    _, dropped = self._entries.popitem(last=False)
                    self.bytes -= dropped.bytes
                self._entries[key] = entry
                self.bytes += entry.bytes


def encoders_checksum(
    slots: Mapping[str, ComponentSlot], uses: Sequence[str], spec: PipelineSpec, device: str
) -> int:
    """Return the xxh3 checksum of the identities of ``uses`` and of every tensor of their
    folders' weight files (a component's own weights file is in its identity)."""
    parts = []
    for name in uses:
        slot = slots[name]
        identity = slot.identity or component_identity(slot, spec, device)
        loader = slot.loader
        files = (
            sorted({path for _, path in loader.stored.values()})
            if isinstance(loader, FolderLoader)
            else []
        )
        parts.append((identity, [tensor_checksums(path) for path in files]))
    return xxhash.xxh3_64_intdigest(msgspec.json.encode(parts))


def counted(hits: int, misses: int, before: PromptCounts | None) -> PromptCounts:
    """Return ``before`` (none yet: zero) with ``hits`` and ``misses`` more rows."""
    base = before or PromptCounts()
    return PromptCounts(hits=base.hits + hits, misses=base.misses + misses)
