"""The component lifecycle (design §3): configured, admitted, loaded, resident,
offloaded, released.

Built from ``lifecycle.machines.tables.TRANSITIONS`` on the guarded engine
(``lifecycle.machines.engine``); guards and work are injected per component by whoever
owns it (the orchestrator).
"""

from __future__ import annotations

import threading

import msgspec

from lifecycle.events import Transitioned
from lifecycle.logs import get_logger
from lifecycle.machines.engine import (
    Guarded,
    GuardedMachine,
    TransitionContext,
    Trigger,
)
from lifecycle.machines.tables import INITIAL_STATE, TRANSITIONS, ComponentState

__all__ = ["ComponentLifecycle", "LifecycleMachine"]

log = get_logger("lifecycle")


class ComponentLifecycle(Guarded):
    """One component's place in the lifecycle; its triggers are typed attributes.

    Create it, then ``LifecycleMachine.add_component`` it (see ``Guarded`` for the
    arguments).
    """

    rules = TRANSITIONS
    noun = "component"
    state: ComponentState

    # one per trigger of the table (a test holds them against it)
    admit = Trigger()
    load = Trigger()
    onload = Trigger()
    offload = Trigger()
    release = Trigger()


class LifecycleMachine(GuardedMachine):
    """The one machine every component of a ``SharedDevice`` shares.

    Built from ``lifecycle.machines.tables.TRANSITIONS``.

    Args:
        name: the machine's name.
        lock: the lock its triggers run under; a fresh one by default.
    """

    states_enum = ComponentState
    rules = TRANSITIONS
    initial_state = INITIAL_STATE

    def __init__(self, name: str = "lifecycle", lock: threading.RLock | None = None) -> None:
        super().__init__(name, lock)

    def add_component(self, component: ComponentLifecycle) -> None:
        """Attach ``component`` in the initial state; its triggers become live."""
        with self.lock:
            self.add_model(component)

    def report_done(self, model: Guarded, context: TransitionContext, duration_ms: float) -> None:
        """Log ``lifecycle.transition`` and emit ``Transitioned``."""
        done = Transitioned(
            component=model.name,
            trigger=context.trigger,
            source=context.source.value,
            dest=context.dest.value,
            duration_ms=duration_ms,
            request_id=context.request_id,
        )
        if context.is_logged:
            log.info("lifecycle.transition", **msgspec.structs.asdict(done))
        if model.observers.attached:
            model.observers.emit(done)
