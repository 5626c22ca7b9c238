"""A pipeline's life on a shared device (design §13): sleep, wake, swap, drain, release.

The orchestrator moves one pipeline's components; this moves the pipeline itself, on
the pipelines' machine of its ``SharedDevice``: a sleep offloads what no awake pipeline
shares, a wake puts back what ``load`` keeps resident once it fits beside what the
other pipelines pin, a drain marks the pipeline on its way out, and its components are
let go of one by one (a shared one stays with its other users). It also weighs the
device for the pipeline's admission: the budget beside what the others pin.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import partial

from components import ResidencyMode
from lifecycle import admission as adm
from lifecycle.admission.budget import declared_bytes
from lifecycle.device.shared import SharedDevice
from lifecycle.device.sharing import ComponentIdentity
from lifecycle.device.slots import ComponentSlot
from lifecycle.events import Observers
from lifecycle.machines.engine import MoveArgs, TransitionContext
from lifecycle.machines.pipeline import PipelineLifecycle
from lifecycle.machines.tables import ComponentState, Guard, PipelineState
from lifecycle.refusals import InvalidTransition, Refusal, RefusalCode

__all__ = ["PipelineLife"]

_STAYING = (PipelineState.SERVING, PipelineState.SLEEPING, PipelineState.SWAPPING)
"""The states of a pipeline that still holds its components: not yet on its way out."""


class PipelineLife:
    """One pipeline's lifecycle on its device: its guards, its work and its triggers.

    Args:
        name: the pipeline's name.
        key: its key on the device.
        shared: the device.
        slots: its components by name: the orchestrator's own mapping, in which an equal
            component another pipeline loaded replaces the pipeline's own.
        observers: who receives its transitions.
        drain_timeout: how long a sleep waits for the pipeline's open requests by default.
    """

    def __init__(
        self,
        name: str,
        key: str,
        shared: SharedDevice,
        slots: Mapping[str, ComponentSlot],
        observers: Observers,
        drain_timeout: float,
    ) -> None:
        self.name = name
        self.key = key
        self._shared = shared
        self._slots = slots
        self._drain_timeout = drain_timeout
        self.lifecycle = PipelineLifecycle(
            name,
            checks={
                Guard.REQUESTS_ENDED: self._requests_ended,
                Guard.MEMORY_BUDGET: self._wake_fits,
            },
            work={"sleep": self._sleep, "wake": self._wake, "release": self._unregister},
            observers=observers,
        )
        shared.add_pipeline(key, self.lifecycle)

    @property
    def state(self) -> PipelineState:
        """Return where the pipeline stands."""
        return self.lifecycle.state

    @property
    def is_staying(self) -> bool:
        """Tell whether the pipeline still holds its components (not draining, not released)."""
        return self.lifecycle.state in _STAYING

    # -- triggers --------------------------------------------------------------

    def sleep(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (``serving.drain_timeout`` by default) for the
        pipeline's open requests, then put it to sleep (see ``Orchestrator.sleep``)."""
        limit = self._drain_timeout if timeout is None else timeout
        with self._shared.lock:
            if self.lifecycle.state is PipelineState.SERVING:
                self._shared.wait_for_requests(self.key, limit)
            self.lifecycle.sleep()

    def wake(self) -> None:
        """Wake the pipeline (see ``Orchestrator.wake``)."""
        self.lifecycle.wake()

    def begin_swap(self) -> None:
        """Mark the pipeline SWAPPING (see ``Orchestrator.begin_swap``)."""
        self.lifecycle.swap()

    def drain(self) -> None:
        """Mark the pipeline DRAINING (see ``Orchestrator.drain``)."""
        self.lifecycle.drain()

    def release(self) -> None:
        """Mark a draining pipeline RELEASED once it let go of every component."""
        if self.lifecycle.state is PipelineState.DRAINING:
            self.lifecycle.release()

    def release_unshared(self, keep: Collection[ComponentIdentity]) -> None:
        """Let go of the components of a draining pipeline, but those whose identity is in
        ``keep`` (see ``Orchestrator.release_unshared``).

        Raises:
            InvalidTransition: the pipeline is not draining.
            TransitionRefused: an open request still uses a component.
        """
        with self._shared.lock:
            state = self.lifecycle.state
            if state is not PipelineState.DRAINING:
                raise InvalidTransition(
                    self.name, "release_unshared", state, ("draining",), noun="pipeline"
                )
            for slot in self._slots.values():
                if slot.identity is None or slot.identity not in keep:
                    self.let_go(slot)

    def let_go(self, slot: ComponentSlot) -> None:
        """Release ``slot``, or leave it to the other pipelines using it.

        Raises:
            TransitionRefused: an open request is using it; the pipeline still holds it.
        """
        if slot.lifecycle.state is ComponentState.RELEASED or self.key not in slot.users:
            return
        if len(slot.users) > 1:
            self._shared.leave(slot, self.key)
            return
        slot.lifecycle.release()

    # -- what admission weighs of the device --------------------------------------

    def admission_budget(self) -> adm.SharedBudget | None:
        """Return the device's budget as admission weighs it, beside the others' pinned.

        A draining pipeline's components leave with it: they are not counted.
        """
        shared = self._shared
        limit = shared.budget.limit
        if limit is None:
            return None
        staying = shared.keys_in(_STAYING)
        pinned = {
            slot.key: slot.footprint or declared_bytes(slot.loader) or 0
            for slot in shared.slots.values()
            if slot.home != self.key
            and slot.spec.is_pinned
            and slot.lifecycle.state is not ComponentState.RELEASED
            and not staying.isdisjoint(slot.users)
        }
        others = tuple(sorted({shared.name_of(key) for key in staying if key != self.key}))
        return adm.SharedBudget(limit=limit, key=shared.budget.key, pinned=pinned, others=others)

    # -- guards (pure: they read the device, touch nothing) -------------------------

    def _requests_ended(self, context: TransitionContext) -> list[Refusal]:
        """Refuse a sleep or a release while the pipeline has open requests."""
        open_now = self._shared.open_requests_of(self.key)
        if not open_now:
            return []
        return [
            Refusal(
                code=RefusalCode.IN_USE,
                component=self.name,
                message=f"pipeline '{self.name}' has open request(s) {', '.join(open_now)}",
                hint="wait for them to end (a sleep waits serving.drain_timeout), or "
                "stop sending requests to this pipeline first",
            )
        ]

    def _wake_fits(self, context: TransitionContext) -> list[Refusal]:
        """Refuse a wake whose resident components cannot fit beside what others pin."""
        budget = self._shared.budget
        if budget.limit is None:
            return []
        waking = [slot for slot in self._own_slots() if _wakes(slot)]
        pinned = [
            slot for slot in budget.charged if slot.spec.is_pinned and self.key not in slot.users
        ]
        sizes = {slot.label(self.key): slot.footprint for slot in (*waking, *pinned)}
        uses = tuple(slot.label(self.key) for slot in waking)
        held = tuple(slot.label(self.key) for slot in pinned)
        if not uses:
            return []
        refusal = adm.stage_fits("wake()", sizes, uses, held, budget.limit, budget_key=budget.key)
        return [] if refusal is None else [refusal]

    # -- work (side effects, each with its undo) ----------------------------------

    def _sleep(self, context: TransitionContext) -> None:
        """Offload what only sleeping pipelines use; mark the pipeline asleep."""
        shared, key = self._shared, self.key
        args = MoveArgs(sleeping=True)
        for slot in self._own_slots():
            awake_users = [u for u in slot.users if u != key and not shared.is_asleep(u)]
            if slot.lifecycle.state is ComponentState.RESIDENT and not awake_users:
                slot.lifecycle.offload(args)
                context.on_rollback(slot.lifecycle.onload)
        shared.sleep(key)
        context.on_rollback(partial(shared.wake, key))

    def _wake(self, context: TransitionContext) -> None:
        """Mark the pipeline awake; onload what ``load`` keeps resident."""
        shared, key = self._shared, self.key
        shared.wake(key)
        context.on_rollback(partial(shared.sleep, key))
        back_off = MoveArgs(sleeping=True)
        for slot in self._own_slots():
            if _wakes(slot):
                lifecycle = slot.lifecycle
                lifecycle.onload()
                context.on_rollback(partial(lifecycle.offload, back_off))

    def _unregister(self, context: TransitionContext) -> None:
        self._shared.unregister(self.key)

    def _own_slots(self) -> list[ComponentSlot]:
        """Return the pipeline's components, each once (two names may share one)."""
        return list({id(slot): slot for slot in self._slots.values()}.values())


def _wakes(slot: ComponentSlot) -> bool:
    """Tell whether waking onloads ``slot``: kept resident, and off the device now."""
    return slot.mode is ResidencyMode.RESIDENT and slot.lifecycle.state is ComponentState.OFFLOADED
