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
from lifecycle.machines.engine import NO_ARGS, Guarded, GuardedMachine, MoveArgs, TransitionContext
from lifecycle.machines.tables import INITIAL_STATE, TRANSITIONS, ComponentState

log = get_logger("lifecycle")


class ComponentLifecycle(Guarded):
    """One component's place in the lifecycle; the triggers are typed methods.

    Create it, then ``LifecycleMachine.add_component`` it (see ``Guarded`` for the
    arguments).
    """

    rules = TRANSITIONS
    noun = "component"
    state: ComponentState

    # The machine binds these; the bodies exist so that type checkers see them.
    def admit(self, args: MoveArgs = NO_ARGS) -> bool:
        """Configured -> admitted."""
        raise NotImplementedError

    def load(self, args: MoveArgs = NO_ARGS) -> bool:
        """Admitted -> loaded."""
        raise NotImplementedError

    def onload(self, args: MoveArgs = NO_ARGS) -> bool:
        """Loaded or offloaded -> resident."""
        raise NotImplementedError

    def offload(self, args: MoveArgs = NO_ARGS) -> bool:
        """Loaded or resident -> offloaded."""
        raise NotImplementedError

    def release(self, args: MoveArgs = NO_ARGS) -> bool:
        """Any state but released -> released."""
        raise NotImplementedError

    def may_admit(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``admit`` would pass its guards now."""
        raise NotImplementedError

    def may_load(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``load`` would pass its guards now."""
        raise NotImplementedError

    def may_onload(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``onload`` would pass its guards now."""
        raise NotImplementedError

    def may_offload(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``offload`` would pass its guards now."""
        raise NotImplementedError

    def may_release(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``release`` would pass its guards now."""
        raise NotImplementedError

    # transitions also binds one state test per state; declaring them keeps it from
    # warning, per model and state, that it skipped them (noise in an embedder's logs)
    def is_CONFIGURED(self) -> bool:  # noqa: N802  (transitions names them after the state)
        """Return whether the component is CONFIGURED."""
        raise NotImplementedError

    def is_ADMITTED(self) -> bool:  # noqa: N802
        """Return whether the component is ADMITTED."""
        raise NotImplementedError

    def is_LOADED(self) -> bool:  # noqa: N802
        """Return whether the component is LOADED."""
        raise NotImplementedError

    def is_RESIDENT(self) -> bool:  # noqa: N802
        """Return whether the component is RESIDENT."""
        raise NotImplementedError

    def is_OFFLOADED(self) -> bool:  # noqa: N802
        """Return whether the component is OFFLOADED."""
        raise NotImplementedError

    def is_RELEASED(self) -> bool:  # noqa: N802
        """Return whether the component is RELEASED."""
        raise NotImplementedError


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
