"""Requests and their stages: in-use counts, onload before a stage, offload after last use."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from components import ResidencyMode
from components.batch import Batch
from lifecycle.residency import Residency
from lifecycle.slots import ComponentSlot
from lifecycle.states import ComponentState
from lifecycle.waiting import MemoryWaiter


class StageKeeper:
    """Move components in and out around the stages of every open request.

    A component is in use while an open request's stage holds it; it is
    onloaded before such a stage and, once idle, offloaded per its mode after
    its last use in the timeline. Stages of one component that follow each
    other share one interval on the device.

    Args:
        slots: the orchestrator's components by name.
        residency: what moves weights (and prefetches the next stage's).
        lock: the machine's lock, held while counts and states change together.
    """

    def __init__(
        self, slots: Mapping[str, ComponentSlot], residency: Residency, lock: threading.RLock
    ) -> None:
        self.slots = slots
        self.residency = residency
        self.timeline = residency.timeline
        self.lock = lock
        self.open_requests: set[str] = set()
        self.waiter = MemoryWaiter(slots, lock, residency.spec.memory.wait_timeout)

    def enter(self, request_id: str, position: int) -> dict[str, nn.Module]:
        """Hold the stage's components for ``request_id`` and make them resident.

        While other requests hold the memory it needs it waits its turn, first come
        first served (``lifecycle.waiting``).

        Raises:
            TransitionRefused: an onload was refused (e.g. the memory budget, also
                after ``memory.wait_timeout``); nothing stays held.
            TransitionFailed: an onload failed; nothing stays held.
        """
        with self.lock:
            stage = self.timeline.stages[position].uses
            return self.waiter.acquire(request_id, stage, lambda: self._hold(request_id, position))

    def _hold(self, request_id: str, position: int) -> dict[str, nn.Module]:
        """Hold and onload every component of the stage, or (raising) none of them."""
        uses = self.timeline.stages[position].uses
        with self.lock:
            for name in uses:
                self.slots[name].holders[request_id] += 1
            try:
                for name in uses:
                    if self.slots[name].lifecycle.state is not ComponentState.RESIDENT:
                        self.slots[name].lifecycle.onload(position=position, request_id=request_id)
            except BaseException:
                self.leave(request_id, position)
                raise
            self.residency.prefetch(self.timeline.added_next(position))
            return {name: _module(self.slots[name]) for name in uses}

    def next_uses(self, position: int) -> tuple[str, ...]:
        """Return the components the stage after ``position`` adds, if there is one."""
        return self.timeline.added_next(position)

    def leave(self, request_id: str, position: int) -> None:
        """Drop ``request_id``'s hold on the stage; offload what saw its last use."""
        uses = self.timeline.stages[position].uses
        with self.lock:
            for name in uses:
                holders = self.slots[name].holders
                holders[request_id] -= 1
                if holders[request_id] <= 0:
                    del holders[request_id]
            self._put_back(self.timeline.last_uses(position), request_id)
            self.waiter.released()

    def finish(self, request_id: str, touched: set[str]) -> None:
        """End ``request_id``: put every component it touched back where its plan says."""
        with self.lock:
            self.open_requests.discard(request_id)
            self.residency.cancel_prefetch(sorted(touched))
            self._put_back(sorted(touched), request_id)
            self.waiter.released()

    def _put_back(self, names: Iterable[str], request_id: str) -> None:
        for name in names:
            slot = self.slots[name]
            if (
                slot.is_idle
                and slot.lifecycle.state is ComponentState.RESIDENT
                and slot.mode is not ResidencyMode.RESIDENT
            ):
                slot.lifecycle.offload(request_id=request_id)


class Request:
    """One request moving through the pipeline's stages (``Orchestrator.request``).

    Attributes:
        id: the request's id, on every event it causes.
        stages: the stages it entered, in order.
    """

    def __init__(self, keeper: StageKeeper, request_id: str) -> None:
        self.id = request_id
        self.stages: list[str] = []
        self.touched: set[str] = set()
        self._keeper = keeper

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, nn.Module]]:
        """Run one stage: yield its components' modules, resident and armed.

        Raises:
            KeyError: no stage has that name.
            TransitionRefused: a component could not be onloaded (budget).
        """
        position = self._keeper.timeline.index(name)
        self.touched.update(self._keeper.timeline.stages[position].uses)
        self.touched.update(self._keeper.next_uses(position))
        modules = self._keeper.enter(self.id, position)
        self.stages.append(name)
        try:
            yield modules
        finally:
            self._keeper.leave(self.id, position)

    def run(self, stage: str, batch: Batch) -> None:
        """Run one stage: each component's kind runs on what ``batch`` carries.

        Raises:
            NotImplementedError: a component's kind does not say how it runs.
        """
        with torch.inference_mode(), self.stage(stage) as modules:
            for name, module in modules.items():
                self._keeper.slots[name].loader.run(module, batch)


def _module(slot: ComponentSlot) -> nn.Module:
    if slot.module is None:
        raise RuntimeError(f"component '{slot.name}' has no module: load() the pipeline first")
    return slot.module
