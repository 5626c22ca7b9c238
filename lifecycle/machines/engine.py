"""The guarded engine every lifecycle runs on: ``transitions`` machines with refusals.

Two extension points of ``transitions`` carry the project's semantics:

- ``transition_cls`` evaluates *every* guard (no short-circuit) and keeps each
  refusal, then runs the injected work atomically: if the work raises or its
  postcondition fails, the undo actions it registered run in reverse and the
  component stays in its source state;
- ``event_cls`` serialises triggers on the machine's lock, turns "no
  transition passed" into ``TransitionRefused`` and "not valid from here" into
  ``InvalidTransition``, and logs one event per outcome.

A move is on the hot path of every request (issue 12: at most 15 µs of
orchestrator time), so the event hands the component and its context straight
to the transition, which runs the guards by name from a tuple built once: no
``EventData`` is built and no callback list is walked. The ``may_*`` probes run
the same guards the same way (``GuardedTransition.passes``), without the work.

A trigger takes one typed value, ``MoveArgs``; what its guards decide for the
work travels on typed fields of the ``TransitionContext``.

The machine knows no loader and no kernel: guards and work are injected per
component by whoever owns the component (the orchestrator). ``GuardedMachine``
holds what the machines of this package share (component, pipeline, adapter, worker:
one module each); each is built from its own table in ``lifecycle.machines.tables``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar, Protocol, TypeAlias, cast, overload

import msgspec
from transitions.core import Condition, Event, Machine, State, Transition

from lifecycle.events import MoveReason, Observers, TriggerRefused
from lifecycle.logs import MAY_WAIT, REQUEST_ID, get_logger
from lifecycle.machines.tables import (
    AdapterState,
    AnyState,
    ComponentState,
    Guard,
    PipelineState,
    TransitionRule,
    WorkerState,
)
from lifecycle.refusals import InvalidTransition, Refusal, TransitionFailed, TransitionRefused

__all__ = [
    "Check",
    "Guarded",
    "GuardedMachine",
    "GuardedTransition",
    "MoveArgs",
    "TransitionContext",
    "Trigger",
    "Work",
    "report_refused",
]

log = get_logger("lifecycle")


class MoveArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a trigger is fired with; its guards and its work read it from the context.

    Attributes:
        request_id: the request the move happens for; None: the one the logging
            context binds (``Orchestrator.request`` binds it), if any.
        position: where in the request timeline the move happens (the stage's index;
            -1 before any stage): the budget measures next uses from there.
        eviction: whether the budget evicts the component to make room for another's
            onload (a component resident by default may go then, never otherwise).
        pipeline: the pipeline whose request moves it (its timeline measures next
            uses); None: the pipeline that owns the component.
        sleeping: its pipeline goes to sleep: it leaves the device even when kept
            resident, or used by no stage (``wake`` brings it back).
        scale: the scale an adapter is merged at by ``activate`` (None: its own
            ``scale``); an unmerged adapter takes each request's scale instead.
        reason: why an onload happens when no stage of its own asks for it (``prefetch``:
            for the next request); written on its ``residency.moved``.
    """

    request_id: str | None = None
    position: int = -1
    eviction: bool = False
    pipeline: str | None = None
    sleeping: bool = False
    scale: float | None = None
    reason: MoveReason | None = None


NO_ARGS = MoveArgs()
"""A trigger fired with nothing to say: outside a stage, not an eviction."""


class TransitionContext:
    """What the guards and the work of one transition see.

    Attributes:
        component: the component's (or pipeline's) name.
        trigger: the trigger being fired.
        source: the state the component is in.
        dest: the state it will be in if the transition completes.
        args: what the trigger was fired with.
        request_id: the request the transition happens for, if any: ``args.request_id``
            when the caller gave one, else the ``request_id`` bound in structlog's
            context variables.
        evictions: the components the onload's budget guard decided to evict first,
            in order (empty when the onload fits as it is).
        is_logged: whether the transition's info-level events (``lifecycle.transition``,
            ``residency.moved``) are written: asked once, so that a filtered move
            builds no event fields.
    """

    __slots__ = (
        "_undo",
        "args",
        "component",
        "dest",
        "evictions",
        "is_logged",
        "refusals",
        "request_id",
        "source",
        "trigger",
    )

    def __init__(
        self,
        component: str,
        trigger: str,
        source: AnyState,
        args: MoveArgs,
        dest: AnyState,
    ) -> None:
        self.component = component
        self.trigger = trigger
        self.source = source
        self.dest = dest
        self.args = args
        request_id = args.request_id if args.request_id is not None else REQUEST_ID.get()
        self.request_id: str | None = None if request_id is ... else request_id
        self.is_logged = log.is_enabled_for(logging.INFO)
        self.refusals: list[Refusal] = []
        self.evictions: tuple[str, ...] = ()
        self._undo: list[Callable[[], object]] = []

    def on_rollback(self, undo: Callable[[], object]) -> None:
        """Register how to undo a step the work just did; undos run newest first."""
        self._undo.append(undo)

    def roll_back(self) -> list[BaseException]:
        """Run every registered undo, newest first; return the errors they raised."""
        errors: list[BaseException] = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as err:  # one broken undo must not stop the others
                errors.append(err)
        return errors


Check: TypeAlias = Callable[[TransitionContext], Iterable[Refusal]]
"""A guard or postcondition: returns the refusals it finds; empty means pass."""

Work: TypeAlias = Callable[[TransitionContext], None]
"""The side effect of a transition; registers undo steps with ``on_rollback``."""


class Guarded:
    """One model on a guarded machine: its name, guards, work and observers.

    Every guard and postcondition its machine's table (``rules``) names must be given
    in ``checks``; ``work`` maps a trigger to its side effect (a trigger without work
    only changes state). Each kind of model declares its table's triggers as
    ``Trigger`` attributes (``onload = Trigger()``): a test holds them against the table.

    Args:
        name: the model's name (a component's, or a pipeline's).
        checks: the check bound to each guard and postcondition.
        work: each trigger's side effect.
        observers: who receives its transitions and refusals; none by default.

    Attributes:
        name: the model's name.
        state: its current state (set by the machine).
        machine: the machine it is on (set when it is added to one).
    """

    rules: ClassVar[Sequence[TransitionRule[Any]]]
    """The table of the machine its kind of model lives on."""
    noun: ClassVar[str]
    """What the model is called in errors (``component``, ``pipeline``)."""
    state: Any
    machine: GuardedMachine | None = None

    def __init__(
        self,
        name: str,
        *,
        checks: Mapping[Guard, Check],
        work: Mapping[str, Work] | None = None,
        observers: Observers | None = None,
    ) -> None:
        needed = {n for r in self.rules for n in (*r.guards, r.postcondition) if n is not None}
        missing = sorted(str(guard) for guard in needed - checks.keys())
        if missing:
            raise ValueError(
                f"{self.noun} {name!r} lacks the checks {missing}; every guard and "
                "postcondition of the transition table must be provided"
            )
        unknown = sorted((work or {}).keys() - {r.trigger for r in self.rules})
        if unknown:
            raise ValueError(f"{self.noun} {name!r} has work for unknown triggers {unknown}")
        self.name = name
        self.checks = dict(checks)
        self.work = dict(work or {})
        self.observers = Observers() if observers is None else observers

    def trigger(self, trigger_name: str, args: MoveArgs = NO_ARGS) -> bool:
        """Fire the trigger named ``trigger_name``, as its ``Trigger`` attribute does."""
        return self.event(trigger_name).trigger(self, args)

    def may_trigger(self, trigger_name: str, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether the trigger named ``trigger_name`` would pass its guards now."""
        return self.event(trigger_name).may(self, args)

    def event(self, trigger_name: str) -> RefusingEvent:
        """Return the event of the trigger named ``trigger_name`` on the model's machine.

        Raises:
            RuntimeError: the model is on no machine yet.
            AttributeError: its table has no such trigger.
        """
        machine = self.machine
        if machine is None:
            raise RuntimeError(f"{self.noun} {self.name!r} is on no machine; add it to one first")
        event = machine.events.get(trigger_name)
        if not isinstance(event, RefusingEvent):
            raise AttributeError(
                f"{self.noun} {self.name!r} has no trigger {trigger_name!r}; "
                f"triggers: {', '.join(r.trigger for r in self.rules)}"
            )
        return event


class BoundTrigger(Protocol):
    """One trigger of one model: call it to fire it, ``may`` to ask without moving."""

    def __call__(self, args: MoveArgs = ..., /) -> bool:
        """Fire the trigger with ``args``; return True once the model moved."""
        ...

    def may(self, args: MoveArgs = ..., /) -> bool:
        """Return whether the trigger would pass its guards now; nothing runs or moves."""
        ...


class _Fire(partial[bool]):
    """``partial(event.trigger, model)``, as fast to call as a bound method, and ``may``
    beside it: what a ``Trigger`` is on one model."""

    may: Callable[..., bool]


class Trigger:
    """A typed trigger of a kind of model, declared in its class: ``onload = Trigger()``.

    Read on a model that is on a machine, it is that model's ``BoundTrigger`` (made
    once, then kept on the model): ``component.onload(MoveArgs(position=2))`` fires
    ``onload`` on the model's machine, ``component.onload.may()`` asks whether it would
    pass. Anything but one ``MoveArgs`` is refused by the event, at run time too.
    """

    name = ""

    def __set_name__(self, owner: type[Guarded], name: str) -> None:
        self.name = name

    @overload
    def __get__(self, model: None, owner: type[Guarded]) -> Trigger: ...

    @overload
    def __get__(self, model: Guarded, owner: type[Guarded]) -> BoundTrigger: ...

    def __get__(self, model: Guarded | None, owner: type[Guarded]) -> Trigger | BoundTrigger:
        if model is None:
            return self
        event = model.event(self.name)
        bound = _Fire(event.trigger, model)
        bound.may = partial(event.may, model)
        model.__dict__[self.name] = bound  # found first from now on: made once per model
        return cast("BoundTrigger", bound)


def triggers_of(kind: type[Guarded]) -> tuple[str, ...]:
    """Return the triggers a kind of model declares (``Trigger`` attributes), in order."""
    return tuple(
        name
        for klass in reversed(kind.__mro__)
        for name, value in vars(klass).items()
        if isinstance(value, Trigger)
    )


class LifecycleState(State):
    """A state whose name is read once (an Enum member's name is a slow lookup).

    Lifecycle states take no entry or exit callbacks: the lifecycle logs one
    event per transition, and ``GuardedTransition`` enters the destination
    without walking callback lists.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.on_enter or self.on_exit:
            raise ValueError("lifecycle states take no entry or exit callbacks; use the work")
        self._plain_name: str = super().name

    @property
    def name(self) -> str:
        """The state's name (the Enum member's name)."""
        return self._plain_name


class GuardCondition(Condition):
    """A guard named in the transition table; ``GuardedTransition.passes`` runs it."""

    def __init__(self, func: str, target: bool = True) -> None:
        if not isinstance(func, str):
            raise TypeError(f"lifecycle guards are named in the transition table, not {func!r}")
        super().__init__(func, target)
        self.name = func  # typed: ``func`` may be any callable to transitions


class GuardedTransition(Transition):
    """A transition that checks every guard and runs its work atomically.

    The work is the transition's one side effect: the lifecycle registers no
    ``transitions`` prepare, before or after callbacks, so ``apply`` does not
    walk those (empty) lists on every move.
    """

    condition_cls = GuardCondition

    def __init__(self, *args: Any, postcondition: Guard | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.postcondition = postcondition
        # the guards' names in table order, resolved once instead of on every move
        self.guard_names = tuple(Guard(str(condition.func)) for condition in self.conditions)
        self.dest_state: AnyState = ComponentState.RELEASED  # set by the event that adds it

    def apply(self, component: Guarded, context: TransitionContext) -> bool:
        """Check every guard; when all pass, run the work, then enter the destination."""
        if not self.passes(component, context):
            return False
        self.run_work(component, context)
        # no callback reads the transition after it (the lifecycle registers none):
        # entering the destination is setting it on the model
        component.state = self.dest_state
        return True

    def passes(self, component: Guarded, context: TransitionContext) -> bool:
        """Run every guard (no short-circuit: a refusal gives every reason); tell if all passed."""
        checks = component.checks
        passed = True
        for name in self.guard_names:
            found = tuple(checks[name](context))
            if found:
                context.refusals.extend(found)
                passed = False
        return passed

    def run_work(self, component: Guarded, context: TransitionContext) -> None:
        """Run the work and check the postcondition; roll back and fail if either breaks."""
        try:
            work = component.work.get(context.trigger)
            if work is not None:
                work(context)
            if self.postcondition is not None:
                breaches = tuple(component.checks[self.postcondition](context))
                if breaches:
                    raise TransitionRefused(
                        component.name, context.trigger, context.source, breaches
                    )
        except BaseException as err:
            undo_errors = context.roll_back()
            for undo_error in undo_errors:
                err.add_note(
                    f"rollback step also failed: {type(undo_error).__name__}: {undo_error}"
                )
            if not isinstance(err, Exception):
                raise
            raise TransitionFailed(component.name, context.trigger, context.source, err) from err


class RefusingEvent(Event):
    """A trigger that is serialised, refuses with reasons and logs its outcome."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # this event's transitions by source state as the model holds it (an Enum
        # member), so that a move finds its candidates without reading the member's name
        self._from: dict[AnyState, list[GuardedTransition]] = {}
        self._dest: AnyState = ComponentState.RELEASED  # every row of a trigger shares one

    def add_transition(self, transition: Transition) -> None:
        """Add a transition from the table (only ``GuardedTransition``s run here)."""
        machine = self.machine
        if not isinstance(transition, GuardedTransition) or not isinstance(machine, GuardedMachine):
            raise TypeError(f"the lifecycle runs GuardedTransition only, not {transition!r}")
        super().add_transition(transition)
        # the states as the model holds them (Enum members), resolved once
        transition.dest_state = self._dest = machine.states_enum[str(transition.dest)]
        self._from.setdefault(machine.states_enum[transition.source], []).append(transition)

    def trigger(self, model: object, *args: Any, **kwargs: Any) -> bool:
        """Fire this trigger for ``model``; its one ``MoveArgs`` reaches guards and work."""
        machine, component = self.machine, model
        if not isinstance(machine, GuardedMachine) or not isinstance(component, Guarded):
            raise TypeError("RefusingEvent runs only on a GuardedMachine with its models")
        # the lifecycle's own calls pass one MoveArgs: tell that at once, without a call
        typed = len(args) == 1 and not kwargs and type(args[0]) is MoveArgs
        move: MoveArgs = args[0] if typed else self._args(args, kwargs)
        with machine.lock:
            source = component.state
            context = TransitionContext(component.name, self.name, source, move, self._dest)
            observers = component.observers
            # timed only when someone reads the duration: a log line or an observer
            is_reported = context.is_logged or observers.attached != ()
            started = time.perf_counter() if is_reported else 0.0
            try:
                # The lock above serialises triggers and the machine registers no queue,
                # prepare, exception or finalize callbacks: try the transitions directly,
                # with the component and context in hand (no EventData to unpack again).
                candidates = self._from.get(source)
                if candidates is None:
                    raise InvalidTransition(
                        component.name,
                        self.name,
                        source,
                        (machine.states_enum[s].value for s in self.transitions),
                        noun=component.noun,
                    )
                for transition in candidates:
                    if transition.apply(component, context):
                        break
                else:
                    raise TransitionRefused(component.name, self.name, source, context.refusals)
            except TransitionRefused as refused:
                # a refusal is rare: its fields are built whatever the level
                report_refused(
                    TriggerRefused(
                        component=component.name,
                        trigger=self.name,
                        source=source.value,
                        codes=tuple(str(code) for code in refused.codes),
                        messages=tuple(r.message for r in refused.refusals) or (str(refused),),
                        request_id=context.request_id,
                        hints=tuple(r.hint for r in refused.refusals),
                        may_wait=MAY_WAIT.get() is True,
                    ),
                    observers,
                )
                raise
            except TransitionFailed as failed:
                log.error(
                    "lifecycle.failed",
                    component=component.name,
                    trigger=self.name,
                    source=source.value,
                    error=str(failed.__cause__),
                    request_id=context.request_id,
                )
                raise
            if is_reported:
                duration_ms = round((time.perf_counter() - started) * 1e3, 3)
                machine.report_done(component, context, duration_ms)
            return True

    def may(self, model: object, *args: Any, **kwargs: Any) -> bool:
        """Tell whether this trigger would pass its guards now; nothing runs, nothing moves.

        The guards run as they do for a move (``GuardedTransition.passes``); a trigger
        not valid from the component's state would not pass.
        """
        machine, component = self._parties(model)
        with machine.lock:
            candidates = self._from.get(component.state)
            if candidates is None:
                return False
            context = TransitionContext(
                component.name, self.name, component.state, self._args(args, kwargs), self._dest
            )
            return any(transition.passes(component, context) for transition in candidates)

    def _parties(self, model: object) -> tuple[GuardedMachine, Guarded]:
        machine = self.machine
        if not isinstance(machine, GuardedMachine) or not isinstance(model, Guarded):
            raise TypeError("RefusingEvent runs only on a GuardedMachine with its models")
        return machine, model

    def _args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> MoveArgs:
        """Return the one ``MoveArgs`` a trigger takes (``transitions`` passes it untyped)."""
        if not kwargs:
            if not args:
                return NO_ARGS
            if len(args) == 1 and isinstance(args[0], MoveArgs):
                return args[0]
        given = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise TypeError(
            f"{self.name}() takes one MoveArgs, not ({given}); "
            f"e.g. {self.name}(MoveArgs(position=2))"
        )


def report_refused(refused: TriggerRefused, observers: Observers) -> None:
    """Log ``refused`` (``lifecycle.refused``, a warning) and hand it to the observers."""
    log.warning(
        "lifecycle.refused",
        component=refused.component,
        trigger=refused.trigger,
        source=refused.source,
        codes=list(refused.codes),
        messages=list(refused.messages),
        hints=list(refused.hints),
        request_id=refused.request_id,
    )
    if observers.attached:
        observers.emit(refused)


class GuardedMachine(Machine):
    """A ``transitions`` machine built from one table of ``lifecycle.machines.tables``.

    Triggers are serialised on ``lock`` (re-entrant, so the work of one transition
    may fire another, e.g. an onload that evicts, a sleep that offloads). Subclasses
    set ``states_enum``, ``rules`` and ``initial_state``, and say how a completed
    transition is reported (``report_done``).

    Args:
        name: the machine's name.
        lock: the lock its triggers run under; a fresh one by default (machines whose
            transitions fire each other's share one).
    """

    state_cls = LifecycleState
    transition_cls = GuardedTransition
    event_cls = RefusingEvent
    states_enum: ClassVar[
        type[ComponentState] | type[PipelineState] | type[WorkerState] | type[AdapterState]
    ]
    rules: ClassVar[Sequence[TransitionRule[Any]]]
    initial_state: ClassVar[AnyState]

    def __init__(self, name: str, lock: threading.RLock | None = None) -> None:
        super().__init__(
            model=None,
            states=self.states_enum,
            initial=self.initial_state,
            send_event=True,
            auto_transitions=False,
            name=name,
        )
        self.lock = threading.RLock() if lock is None else lock
        # transitions keys states by Enum name; reading a member's name costs an Enum lookup
        self._by_key = {
            key: self.states[member.name]
            for member in self.states_enum
            for key in (member, member.name)
        }
        for rule in self.rules:
            self.add_transition(
                rule.trigger,
                list(rule.sources),
                rule.dest,
                conditions=list(rule.guards),
                postcondition=rule.postcondition,
            )

    _by_key: Mapping[object, State] = {}

    def get_state(self, state: Any) -> State:
        """Return the State object of a state or its name, in one dictionary lookup."""
        found = self._by_key.get(state)
        return super().get_state(state) if found is None else found

    def get_model_state(self, model: Any) -> State:
        """Return the State object of ``model``'s current state."""
        return self.get_state(model.state)

    def add_model(self, model: Any, initial: Any = None) -> None:
        """Attach ``model`` (a ``Guarded``) in the initial state; its triggers become live."""
        with self.lock:
            super().add_model(model, initial)
            for added in model if isinstance(model, list) else [model]:
                added.machine = self

    def _checked_assignment(self, model: Any, name: str, func: Any) -> None:
        """Bind nothing onto a model: its kind declares its triggers (``Trigger``), which
        fire through ``Guarded.trigger`` and probe through ``may``, the one way moves run.
        ``transitions``' ``is_<state>`` and ``may_<trigger>`` conveniences are not used."""

    def report_done(self, model: Guarded, context: TransitionContext, duration_ms: float) -> None:
        """Log a completed transition and hand it to ``model``'s observers.

        Called only when one of them reads it (``context.is_logged``, or an observer).
        """
        raise NotImplementedError

    def transitions_of(self, trigger: str) -> list[GuardedTransition]:
        """Return the machine's transitions for ``trigger``, one per source state."""
        found: list[GuardedTransition] = []
        for per_source in self.events[trigger].transitions.values():
            found.extend(t for t in per_source if isinstance(t, GuardedTransition))
        return found
