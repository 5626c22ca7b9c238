"""Waiting for memory: an onload that cannot fit only because other requests hold
components waits its turn, by priority with ageing, instead of being refused
(design §5.5, §15).

The order and its bound are ``lifecycle.device.priorities``'s: a turn is a stage
granted to a waiter; every other waiter ages by one. With one priority the order is FIFO, but
for one rule that keeps the device from thrashing: a stage whose components are all
resident needs no move, so it may go ahead of older stages, by up to ``LEAD`` turns
of their ageing and never ahead of a higher priority that needs a move; those that
may go at once, in no set order, while the first in line waits
(``priorities.may_go``). And a stage that lets go of a component a request that may
go now uses hands it over: it stays resident instead of being offloaded and
onloaded again at once. So requests that need what is on the device go while it is
there, and a component moves once for all of those waiting for it, not once each.

Why this cannot deadlock:

1. *No hold and wait.* A request waits only while it holds no component: a stage's
   components are acquired together (all held and onloaded, or none: a refused
   attempt drops every hold before waiting), and a request that already holds
   another stage (nested stages) is refused at once instead of waiting.
2. *Holders always finish.* Whoever holds components is running a stage body
   (compute, no lock, no waiting) and drops its holds when the stage ends; every
   drop wakes the waiters.
3. *The head always fits eventually.* Admission refuses a pipeline whose largest
   stage does not fit the budget together with the pinned components; so once
   every holder has dropped its holds, the head's stage fits after evicting idle
   components (one handed over is idle too). Only requests that may go acquire:
   the head, or one that goes ahead of it, holding nothing either and needing no
   move; every such turn ages the head, which bounds how often that happens
   (``lifecycle.device.priorities``). Past that only the head acquires, and the set of
   holders only shrinks.

Hence the head of the queue always progresses, and every waiter becomes the head.
``memory.wait_timeout`` bounds the wait anyway: past it the request is refused with
``residency.memory_budget``, naming the requests that hold what it needs. A request
cancelled while it waits (``Request.cancel()``) leaves the queue at once.

Several pipelines on one device wait in one line: the argument holds across them,
since a worker's admission checks each pipeline's stages against the shared budget
beside every other pipeline's pinned components.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from components.batch import Cancelled
from lifecycle.device.priorities import PriorityQueue
from lifecycle.device.slots import ComponentSlot
from lifecycle.events import MemoryWait, Observers
from lifecycle.logs import MAY_WAIT, get_logger
from lifecycle.machines.tables import ComponentState
from lifecycle.refusals import Refusal, RefusalCode, TransitionRefused
from lifecycle.spec.structs import StageSpec

__all__ = ["LEAD", "MemoryWaiter", "WaitTerms"]

log = get_logger("lifecycle")  # follows a later configure_logging, as the machine's does

T = TypeVar("T")

_RESIDENT = ComponentState.RESIDENT

LEAD = 32
"""The turns of ageing by which a stage whose components are all resident may go ahead of
older stages (``lifecycle.device.priorities.may_go``); each stage that does ages them, so that
past it they go first. A holder's stage lasts about a turn of every other open request,
so the lead is two turns for each of 16: at 16 threads (``benchmarks/contention.py``)
a lead of 16 still left 117 of 320 denoising stages that needed no move queued behind
one that did, 32 left 10."""


@dataclass(frozen=True)
class WaitTerms:
    """How one pipeline's requests wait.

    Attributes:
        timeout: its ``memory.wait_timeout`` in seconds.
        observers: who receives a ``MemoryWait`` for every wait, however it ends.
        slots: its components by the names its stages use.
    """

    timeout: float
    observers: Observers
    slots: Mapping[str, ComponentSlot]


class MemoryWaiter:
    """Let requests wait, by priority with ageing, for others to release the device.

    Args:
        slots: every component on the device, by key.
        lock: the machine's lock; waiting releases it.
    """

    def __init__(self, slots: Mapping[str, ComponentSlot], lock: threading.RLock) -> None:
        self.slots = slots
        self._turns = threading.Condition(lock)
        self._queue: PriorityQueue[str] = PriorityQueue()
        self._stages: dict[str, StageSpec] = {}  # what each waiting request waits to enter
        self._uses: dict[str, tuple[ComponentSlot, ...]] = {}  # and its components
        self._listeners: list[Callable[[], object]] = []

    def on_change(self, listener: Callable[[], object]) -> None:
        """Call ``listener`` (with the lock held) whenever a request joins the line or
        leaves it: a request behind others joins without an attempt, so no event says it
        waits (a status page learns it from here)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def acquire(
        self,
        request_id: str,
        position: int,
        stage: StageSpec,
        attempt: Callable[[str, int], T],
        release: Callable[[str, int], object],
        terms: WaitTerms,
        *,
        priority: int = 0,
        check: Callable[[], object] = lambda: None,
    ) -> T:
        """Run ``attempt`` (use and onload ``stage``) when it may; wait while others use it.

        Call with the lock held. ``attempt(request_id, position)`` marks in use every
        component of ``stage``, the stage at ``position``, or, when it raises, none;
        ``release(request_id, position)`` lets go of what a successful ``attempt`` holds,
        should anything after it fail (writing the wait's event). ``terms`` are the
        pipeline's. Waiters go in order of ``priority`` with ageing (see the module);
        ``check`` is asked on every wake-up and raises ``Cancelled`` to stop waiting.

        Raises:
            TransitionRefused: the budget refused for another reason than other
                requests' holds, or they still held it after ``terms.timeout``; the
                refusal names them.
            TransitionFailed: an onload failed.
            Cancelled: ``check`` said the request was cancelled while it waited.
        """
        last: TransitionRefused | None = None
        if not self._queue:
            try:
                return self._try(attempt, request_id, position)
            except TransitionRefused as err:
                if not self._should_wait(err, request_id):
                    raise
                last = err
        started = time.monotonic()
        deadline = started + terms.timeout
        self._queue.push(request_id, priority)
        self._stages[request_id] = stage
        self._uses[request_id] = tuple(terms.slots[name] for name in stage.uses)
        self._changed()
        waited = False
        try:
            while True:
                try:
                    check()
                except Cancelled:
                    self._record(request_id, stage, started, "cancelled", terms)
                    raise
                if request_id in self._going():
                    try:
                        result = self._try(attempt, request_id, position)
                    except TransitionRefused as err:
                        if not self._should_wait(err, request_id):
                            raise
                        last = err
                    else:
                        self._queue.served()  # every other waiter was passed over: it ages
                        try:
                            if waited or last is not None:  # else it never waited
                                self._record(request_id, stage, started, "acquired", terms)
                        except BaseException:
                            # an event that cannot be written must not keep the stage
                            release(request_id, position)
                            raise
                        return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._record(request_id, stage, started, "refused", terms)
                    raise self._timed_out(last, stage.uses, terms)
                waited = True
                self._turns.wait(remaining)
        finally:
            self._queue.remove(request_id)
            del self._stages[request_id]
            del self._uses[request_id]
            self._turns.notify_all()  # the next in line may try now
            self._changed()

    def _going(self) -> list[str]:
        """Return the waiting requests that may go now (call with the lock held): those
        whose stage needs no move, up to ``LEAD`` turns behind the first in line, else
        the first in line (``lifecycle.device.priorities.may_go``)."""
        uses = self._uses
        ready = {
            rid for rid, slots in uses.items() if all(s.lifecycle.state is _RESIDENT for s in slots)
        }
        return self._queue.going(ready, LEAD)

    @staticmethod
    def _try(attempt: Callable[[str, int], T], request_id: str, position: int) -> T:
        """Run ``attempt``; its refusals' events say a refusal here may only mean a wait."""
        token = MAY_WAIT.set(True)
        try:
            return attempt(request_id, position)
        finally:
            MAY_WAIT.reset(token)

    @property
    def queue(self) -> tuple[str, ...]:
        """Return the ids of the waiting requests, first in line first."""
        return tuple(self._queue)

    def waiting(self) -> tuple[tuple[str, StageSpec], ...]:
        """Return each waiting request with the stage it waits to enter, first in line first."""
        stages = dict(self._stages)  # one copy: the waiting threads change it under the lock
        return tuple((rid, stages[rid]) for rid in tuple(self._queue) if rid in stages)

    def wanted(self) -> set[ComponentSlot]:
        """Return the components of the waiting requests that may go now (none when none
        waits): a stage that lets go of one of them hands it over instead of putting it
        back (call with the lock held)."""
        if not self._queue:
            return set()
        return {slot for rid in self._going() for slot in self._uses[rid]}

    def released(self) -> None:
        """Wake the waiters: a request dropped holds (call with the lock held)."""
        if self._queue:  # whoever waits on the condition is in the queue
            self._turns.notify_all()

    def wake(self) -> None:
        """Wake the waiters from any thread, so that a cancelled one leaves at once."""
        with self._turns:
            self.released()

    def users(self) -> dict[str, list[str]]:
        """Return each request that holds (uses) a component, with what it holds.

        A component is named as its home pipeline calls it.
        """
        held: dict[str, list[str]] = {}
        for slot in self.slots.values():
            for rid in slot.in_use_by:
                held.setdefault(rid, []).append(slot.name)
        return held

    def _should_wait(self, err: TransitionRefused, request_id: str) -> bool:
        """Wait only on a budget refusal, while others hold components and we hold none."""
        users = self.users()
        others = [rid for rid in users if rid != request_id]
        holds_nothing = request_id not in users
        return RefusalCode.MEMORY_BUDGET in err.codes and bool(others) and holds_nothing

    def _timed_out(
        self, err: TransitionRefused | None, uses: Sequence[str], terms: WaitTerms
    ) -> TransitionRefused:
        held = self.users()
        named = "; ".join(f"request {rid} holds {', '.join(names)}" for rid, names in held.items())
        component = uses[0] if err is None else err.component
        refusal = Refusal(
            code=RefusalCode.MEMORY_BUDGET,
            component=component,
            message=f"waited {terms.timeout:g} s for memory for stage components "
            f"{', '.join(uses)}, but other requests still hold the device "
            f"({named or 'none now'}; {len(self._queue) - 1} other request(s) waiting)"
            + ("" if err is None else f": {err.refusals[0].message}"),
            hint="those requests are running, not stuck: raise memory.wait_timeout, raise "
            "memory.device_budget so more stages fit at once, or send fewer concurrent "
            "requests (serving.max_queue)",
        )
        source = terms.slots[uses[0]].lifecycle.state if err is None else err.source
        return TransitionRefused(component, "onload", source, [refusal])

    def _record(
        self,
        request_id: str,
        stage: StageSpec,
        started: float,
        outcome: Literal["acquired", "refused", "cancelled"],
        terms: WaitTerms,
    ) -> None:
        """Say that ``request_id`` waited since ``started`` to enter ``stage``, and how it ended."""
        seconds = round(time.monotonic() - started, 6)
        log.info(
            "residency.waited",
            request_id=request_id,
            stage=stage.name,
            components=list(stage.uses),
            seconds=seconds,
            outcome=outcome,
        )
        if terms.observers.attached:
            wait = MemoryWait(
                request_id=request_id,
                stage=stage.name,
                components=stage.uses,
                seconds=seconds,
                outcome=outcome,
            )
            terms.observers.emit(wait)
