"""The adapter lifecycle (design §14): configured, admitted, loaded, active, released.

Built from ``lifecycle.machines.tables.ADAPTER_TRANSITIONS`` on the same guarded machine as the
components (every guard checked, refusals with reasons, atomic work), and on the lock
of the components' machine, so that an adapter never changes a component's weights
while a transition of that component (or a request's hold on it) is half done. Guards
and work are injected by the orchestrator's ``lifecycle.adapters.AdapterKeeper``.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from lifecycle.events import AdapterTransitioned, Observers
from lifecycle.logs import get_logger
from lifecycle.machines.engine import (
    Check,
    Guarded,
    GuardedMachine,
    TransitionContext,
    Trigger,
    Work,
)
from lifecycle.machines.tables import (
    ADAPTER_TRANSITIONS,
    INITIAL_ADAPTER_STATE,
    AdapterState,
    Guard,
)

__all__ = ["AdapterLifecycle", "AdapterMachine"]

log = get_logger("lifecycle")


class AdapterLifecycle(Guarded):
    """One adapter's place in its lifecycle; its triggers are typed attributes.

    Create it, then ``AdapterMachine.add_adapter`` it (see ``Guarded`` for the
    arguments).

    Args:
        component: the component whose weights it changes.
    """

    rules = ADAPTER_TRANSITIONS
    noun = "adapter"
    state: AdapterState

    def __init__(
        self,
        name: str,
        *,
        component: str,
        checks: Mapping[Guard, Check],
        work: dict[str, Work] | None = None,
        observers: Observers | None = None,
    ) -> None:
        super().__init__(name, checks=checks, work=work, observers=observers)
        self.component = component

    # one per trigger of the table (a test holds them against it)
    admit = Trigger()
    load = Trigger()
    activate = Trigger()
    deactivate = Trigger()
    release = Trigger()


class AdapterMachine(GuardedMachine):
    """The machine every adapter of an orchestrator shares, on its components' lock.

    Args:
        name: the machine's name.
        lock: the lock its triggers run under (the components' machine's).
    """

    states_enum = AdapterState
    rules = ADAPTER_TRANSITIONS
    initial_state = INITIAL_ADAPTER_STATE

    def add_adapter(self, adapter: AdapterLifecycle) -> None:
        """Attach ``adapter`` in the initial state; its triggers become live."""
        with self.lock:
            self.add_model(adapter)

    def report_done(self, model: Guarded, context: TransitionContext, duration_ms: float) -> None:
        """Log ``adapter.transition`` and emit ``AdapterTransitioned``."""
        assert isinstance(model, AdapterLifecycle)
        done = AdapterTransitioned(
            adapter=model.name,
            component=model.component,
            trigger=context.trigger,
            source=context.source.value,
            dest=context.dest.value,
            duration_ms=duration_ms,
            request_id=context.request_id,
        )
        if context.is_logged:
            log.info("adapter.transition", **msgspec.structs.asdict(done))
        if model.observers.attached:
            model.observers.emit(done)
