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
import time
from collections.abc import Collection, Iterable, Mapping, Sequence

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
from lifecycle.machines.tables import ComponentState, PipelineState
from lifecycle.spec.structs import PipelineSpec, WorkerFile

__all__ = ["SharedDevice", "worker_budget"]

log = get_logger("lifecycle")


class SharedDevice:
    """What the orchestrators on one device share.

    The device owns what it knows of its pipelines and their requests: each is written
    through one of its methods (``register``, ``open_request``, ``sleep``, ...), under
    its lock, and read through the others.

    Args:
        device_budget: the most bytes resident at once, for every pipeline together;
            None: no limit.
        budget_key: where that budget was set, named in refusals' hints.
        serves: it is a worker's (``lifecycle serve``): its pipelines' finished videos are
            kept on the host, and their admission counts them.

    Attributes:
        lock: the one lock every trigger of every pipeline runs under.
        machine: the machine of every component.
        pipelines: the machine of every pipeline.
        budget: the device budget and its running total.
        waiter: the line of requests waiting for memory.
        serves: it is a worker's.
    """

    def __init__(
        self,
        *,
        device_budget: int | None = None,
        budget_key: str = "memory.device_budget",
        serves: bool = False,
    ) -> None:
        self.serves = serves
        self.lock = threading.RLock()
        self.machine = LifecycleMachine("components", self.lock)
        self.pipelines = PipelineMachine("pipelines", self.lock)
        self._slots: dict[str, ComponentSlot] = {}
        self._open_requests: dict[str, str] = {}  # request id -> its pipeline's key
        self._asleep: set[str] = set()
        self._timelines: dict[str, Timeline] = {}
        self._last_asked: dict[str, int] = {}
        self._lifecycles: dict[str, PipelineLifecycle] = {}
        self._names: dict[str, str] = {}  # key -> the pipeline's name
        self._counts: dict[str, int] = {}  # name -> pipelines of that name registered
        self._request_ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._requests_ended = threading.Condition(self.lock)
        self._loaded: dict[ComponentIdentity, ComponentSlot] = {}
        self._kind: str | None = None
        self.budget = DeviceBudget(device_budget, budget_key, self)
        self.waiter = MemoryWaiter(self._slots, self.lock)

    # -- pipelines -------------------------------------------------------------

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
            count = self._counts[name] = self._counts.get(name, 0) + 1
            key = name if count == 1 and name not in self._timelines else f"{name}#{count}"
            self._timelines[key] = timeline
            self._last_asked[key] = 0
            self._names[key] = name
            return key

    def add_pipeline(self, key: str, lifecycle: PipelineLifecycle) -> None:
        """Put the lifecycle of the pipeline ``key`` on the pipelines' machine."""
        with self.lock:
            self.pipelines.add_pipeline(lifecycle)
            self._lifecycles[key] = lifecycle

    def unregister(self, key: str) -> None:
        """Forget the pipeline ``key`` (released): its timeline, its sleep, its recency."""
        with self.lock:
            self._timelines.pop(key, None)
            self._last_asked.pop(key, None)
            self._asleep.discard(key)
            self._names.pop(key, None)
            self._lifecycles.pop(key, None)

    def name_of(self, key: str) -> str:
        """Return the name of the pipeline ``key`` (the key itself once it is gone)."""
        return self._names.get(key, key)

    def timeline_of(self, key: str) -> Timeline:
        """Return the request timeline of the pipeline ``key``."""
        return self._timelines[key]

    def last_asked(self, key: str) -> int:
        """Return when the pipeline ``key`` last opened a request (a device-wide count)."""
        return self._last_asked.get(key, 0)

    def keys_in(self, states: Collection[PipelineState]) -> set[str]:
        """Return the keys of the pipelines whose lifecycle is in one of ``states``."""
        with self.lock:
            return {key for key, life in self._lifecycles.items() if life.state in states}

    def sleep(self, key: str) -> None:
        """Mark the pipeline ``key`` asleep: its unshared components stay off the device."""
        with self.lock:
            self._asleep.add(key)

    def wake(self, key: str) -> None:
        """Mark the pipeline ``key`` awake."""
        with self.lock:
            self._asleep.discard(key)

    def is_asleep(self, key: str) -> bool:
        """Tell whether the pipeline ``key`` sleeps."""
        return key in self._asleep

    def all_asleep(self, keys: Iterable[str]) -> bool:
        """Tell whether every pipeline of ``keys`` sleeps (none does, most of the time)."""
        asleep = self._asleep
        return bool(asleep) and all(key in asleep for key in keys)

    # -- requests --------------------------------------------------------------

    def next_request_id(self) -> str:
        """Return a request id no request on this device had (``r1``, ``r2``, ...)."""
        return f"r{next(self._request_ids)}"

    def open_request(self, request_id: str, key: str) -> None:
        """Open ``request_id`` for the pipeline ``key``, which was asked for now.

        Raises:
            ValueError: a request with that id is open already.
        """
        with self.lock:
            if request_id in self._open_requests:
                raise ValueError(
                    f"request {request_id!r} is already open; give each request its own id"
                )
            self._open_requests[request_id] = key
            self._last_asked[key] = next(self._clock)

    def close_request(self, request_id: str) -> None:
        """Close ``request_id``; wake whoever waits for requests to end (a sleep, a drain)."""
        with self.lock:
            self._open_requests.pop(request_id, None)
            self._requests_ended.notify_all()

    def pipeline_of(self, request_id: str) -> str | None:
        """Return the key of the pipeline ``request_id`` is open for; None when it is not."""
        return self._open_requests.get(request_id)

    def open_requests_of(self, key: str) -> list[str]:
        """Return the open requests of the pipeline ``key``, sorted."""
        with self.lock:
            return sorted(rid for rid, owner in self._open_requests.items() if owner == key)

    def wait_for_requests(self, key: str, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the open requests of the pipeline ``key`` to end."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.open_requests_of(key) and (remaining := deadline - time.monotonic()) > 0:
                self._requests_ended.wait(remaining)

    # -- components ------------------------------------------------------------

    @property
    def slots(self) -> Mapping[str, ComponentSlot]:
        """Every component on the device, by its key."""
        return self._slots

    def add_slot(self, slot: ComponentSlot) -> None:
        """Put ``slot`` on the device (its lifecycle is on ``machine`` already)."""
        with self.lock:
            self._slots[slot.key] = slot

    def drop_slot(self, slot: ComponentSlot) -> None:
        """Take ``slot`` off the device: released, or replaced by an equal shared one."""
        with self.lock:
            self._slots.pop(slot.key, None)
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
