"""Waiting for memory: an onload that cannot fit only because other requests hold
components waits its turn, by priority with ageing, instead of being refused
(design §5.5, §15).

The order and its bound are ``lifecycle.device.priorities``'s: a turn is a stage granted to
a waiter; every other waiter ages by one. With one priority the order is FIFO.

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
   components. Only the head acquires, so while it waits the set of holders only
   shrinks; a newcomer that goes ahead of it holds nothing either, and ageing
   bounds how often that happens.

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
from lifecycle.refusals import Refusal, RefusalCode, TransitionRefused
from lifecycle.spec.structs import StageSpec

log = get_logger("lifecycle")  # follows a later configure_logging, as the machine's does

T = TypeVar("T")


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
        if not self._queue:
            try:
                return self._try(attempt, request_id, position)
            except TransitionRefused as err:
                if not self._should_wait(err, request_id):
                    raise
        started = time.monotonic()
        deadline = started + terms.timeout
        last: TransitionRefused | None = None
        self._queue.push(request_id, priority)
        self._stages[request_id] = stage
        try:
            while True:
                try:
                    check()
                except Cancelled:
                    self._record(request_id, stage, started, "cancelled", terms)
                    raise
                if self._queue.head() is request_id:
                    try:
                        result = self._try(attempt, request_id, position)
                    except TransitionRefused as err:
                        if not self._should_wait(err, request_id):
                            raise
                        last = err
                    else:
                        self._queue.served()  # every other waiter was passed over: it ages
                        try:
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
                self._turns.wait(remaining)
        finally:
            self._queue.remove(request_id)
            del self._stages[request_id]
            self._turns.notify_all()  # the next in line may try now

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
