"""One device shared by several pipelines: one lock, one budget, one line of waiters.

Every orchestrator works on a ``SharedDevice``. ``Orchestrator(spec)`` makes a private
one (its budget is the spec's ``memory.device_budget``); a worker serving several
pipelines makes one and hands it to each (``Orchestrator(spec, shared=device)``), so
that:

- every component of every pipeline is on one ``LifecycleMachine`` and every pipeline
  on one ``PipelineMachine``, both under one lock: a move of one pipeline never
  interleaves with a move of another;
- one ``DeviceBudget`` charges every resident component, and an onload may evict any
  pipeline's idle component (the pipeline asked for least recently first);
- one ``MemoryWaiter`` queues the requests of every pipeline, first come first served;
- equal components are held once (``lifecycle.device.sharing``): the device keeps each
  loaded component by its identity, and a pipeline loading an equal one uses it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import msgspec

from lifecycle.device.budget import DeviceBudget
from lifecycle.device.sharing import ComponentIdentity
from lifecycle.device.slots import ComponentSlot
from lifecycle.device.timeline import Timeline
from lifecycle.device.waiting import MemoryWaiter
from lifecycle.events import Observers
from lifecycle.logs import get_logger
from lifecycle.machines.component import LifecycleMachine
from lifecycle.machines.pipeline import PipelineLifecycle, PipelineMachine
from lifecycle.machines.tables import ComponentState
from lifecycle.spec.structs import PipelineSpec, WorkerFile

log = get_logger("lifecycle")


class SharedDevice:
    """What the orchestrators on one device share.

    Args:
        device_budget: the most bytes resident at once, for every pipeline together;
            None: no limit.
        budget_key: where that budget was set, named in refusals' hints.

    Attributes:
        lock: the one lock every trigger of every pipeline runs under.
        machine: the machine of every component.
        pipelines: the machine of every pipeline.
        budget: the device budget and its running total.
        waiter: the line of requests waiting for memory.
        slots: every component on the device, by its key.
        open_requests: the pipeline (its key) of each open request, by request id.
        asleep: the pipelines (keys) that sleep: their unshared components stay off.
        requests_ended: notified whenever a request ends (a sleep waits on it).
        lifecycles: each pipeline's lifecycle, by its key.
        names: each pipeline's name, by its key.
    """

    def __init__(
        self, *, device_budget: int | None = None, budget_key: str = "memory.device_budget"
    ) -> None:
        self.lock = threading.RLock()
        self.machine = LifecycleMachine("components", self.lock)
        self.pipelines = PipelineMachine("pipelines", self.lock)
        self.slots: dict[str, ComponentSlot] = {}
        self.open_requests: dict[str, str] = {}
        self.asleep: set[str] = set()
        self.timelines: dict[str, Timeline] = {}
        self.last_asked: dict[str, int] = {}
        self.request_ids = itertools.count(1)
        self.budget = DeviceBudget(
            device_budget, budget_key, self.open_requests, self.timelines, self.last_asked
        )
        self.waiter = MemoryWaiter(self.slots, self.lock)
        self.requests_ended = threading.Condition(self.lock)
        self._clock = itertools.count(1)
        self._loaded: dict[ComponentIdentity, ComponentSlot] = {}
        self._names: dict[str, int] = {}
        self._kind: str | None = None
        self.lifecycles: dict[str, PipelineLifecycle] = {}
        self.names: dict[str, str] = {}

    def register(self, name: str, timeline: Timeline, kind: str) -> str:
        """Take in the pipeline ``name`` with its timeline; return its key on this device.

        Two pipelines of one name may be on the device at once (a swap holds the old
        and the new while both fit); the second gets the key ``name#2``.

        Raises:
            ValueError: the pipeline runs on another kind of device (``kind``: cpu,
                cuda) than those already on it: one budget cannot cover two devices.
        """
        with self.lock:
            if self._kind not in (None, kind):
                raise ValueError(
                    f"pipeline '{name}' runs on {kind}, the others on this device on "
                    f"{self._kind}; give every spec the same device, or serve it elsewhere"
                )
            self._kind = kind
            count = self._names[name] = self._names.get(name, 0) + 1
            key = name if count == 1 and name not in self.timelines else f"{name}#{count}"
            self.timelines[key] = timeline
            self.last_asked[key] = 0
            self.names[key] = name
            return key

    def unregister(self, key: str) -> None:
        """Forget the pipeline ``key`` (released): its timeline, its sleep, its recency."""
        with self.lock:
            self.timelines.pop(key, None)
            self.last_asked.pop(key, None)
            self.asleep.discard(key)
            self.names.pop(key, None)

    def asked(self, key: str) -> None:
        """Note that the pipeline ``key`` opened a request now (call with the lock held)."""
        self.last_asked[key] = next(self._clock)

    def add_slot(self, slot: ComponentSlot) -> None:
        """Put ``slot`` on the device (its lifecycle is on ``machine`` already)."""
        with self.lock:
            self.slots[slot.key] = slot

    def drop_slot(self, slot: ComponentSlot) -> None:
        """Take ``slot`` off the device: released, or replaced by an equal shared one."""
        with self.lock:
            self.slots.pop(slot.key, None)
            for identity, loaded in list(self._loaded.items()):
                if loaded is slot:
                    del self._loaded[identity]
            if slot.lifecycle in self.machine.models:  # its triggers stay bound: a last
                self.machine.remove_model(slot.lifecycle)  # transition may still finish

    def loaded_equal(self, identity: ComponentIdentity) -> ComponentSlot | None:
        """Return the live component of ``identity`` another pipeline loaded, if any."""
        with self.lock:
            found = self._loaded.get(identity)
            if found is None or found.lifecycle.state is ComponentState.RELEASED:
                return None
            return found

    def offer(self, identity: ComponentIdentity, slot: ComponentSlot) -> None:
        """Let pipelines loading a component of ``identity`` share the loaded ``slot``."""
        with self.lock:
            self._loaded.setdefault(identity, slot)

    def join(self, slot: ComponentSlot, key: str, name: str, observers: Observers) -> None:
        """Make pipeline ``key`` a user of ``slot`` (its own component ``name``).

        The component's transitions and moves then reach every user's observers.
        """
        with self.lock:
            slot.users[key] = name
            slot.join_observers(key, observers)
            log.info(
                "lifecycle.shared",
                component=slot.name,
                pipelines=sorted(slot.users),
                saved_bytes=slot.nbytes,
            )

    def leave(self, slot: ComponentSlot, key: str) -> bool:
        """Take pipeline ``key`` off ``slot``'s users; tell whether others still use it."""
        with self.lock:
            slot.users.pop(key, None)
            slot.leave_observers(key)
            return bool(slot.users)

    def saved_bytes(self) -> int:
        """Return the bytes sharing saves: each shared component once per extra user."""
        with self.lock:
            return sum(
                slot.nbytes * (len(slot.users) - 1)
                for slot in self.slots.values()
                if len(slot.users) > 1
            )

    def resident_bytes(self) -> int:
        """Return the bytes every pipeline's resident components hold on the device."""
        with self.lock:
            return sum(
                slot.store.resident_bytes()
                for slot in self.slots.values()
                if slot.store is not None
            )


def worker_budget(
    specs: Sequence[PipelineSpec], given: int | None, file: WorkerFile | None
) -> tuple[int | None, str]:
    """Return the budget a worker's device holds its pipelines to, and where it was set.

    ``--device-budget`` (``given``) first, then the worker file's ``[worker]
    device_budget``; without either, the smallest ``memory.device_budget`` of the specs
    (each spec's limit holds then), or none.
    """
    if given is not None:
        return given, "--device-budget"
    if file is not None and not isinstance(file.worker.device_budget, msgspec.UnsetType):
        return file.worker.device_budget, "worker.device_budget"
    own = [
        spec.memory.device_budget
        for spec in specs
        if not isinstance(spec.memory.device_budget, msgspec.UnsetType)
    ]
    return (min(own), "memory.device_budget") if own else (None, "memory.device_budget")
