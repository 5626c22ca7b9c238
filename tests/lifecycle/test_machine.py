"""The lifecycle machine: the whole transition table, refusals, atomic work."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import structlog

from lifecycle.machines.adapter import AdapterLifecycle
from lifecycle.machines.component import ComponentLifecycle, LifecycleMachine
from lifecycle.machines.engine import (
    Check,
    Guarded,
    MoveArgs,
    TransitionContext,
    Work,
    triggers_of,
)
from lifecycle.machines.pipeline import PipelineLifecycle
from lifecycle.machines.tables import (
    ADAPTER_TRANSITIONS,
    GUARDS,
    PIPELINE_TRANSITIONS,
    TRANSITIONS,
    TRIGGERS,
    WORKER_TRANSITIONS,
    ComponentState,
    Guard,
    TransitionRule,
)
from lifecycle.machines.worker import WorkerLifecycle
from lifecycle.refusals import InvalidTransition, Refusal, TransitionFailed, TransitionRefused
from lifecycle.testing import capture_events, events_named

ALL_CHECKS = (*GUARDS, *(r.postcondition for r in TRANSITIONS if r.postcondition))


def passing_checks(**overrides: Check) -> dict[str, Check]:
    """Return a check for every name the table uses: all pass unless overridden."""
    checks: dict[str, Check] = {name: lambda context: () for name in ALL_CHECKS}
    checks.update(overrides)
    return checks


def refusing(code: str, message: str) -> Check:
    """Return a check that refuses with ``code``."""

    def check(context: TransitionContext) -> Iterable[Refusal]:
        return [Refusal(code=code, component=context.component, message=message, hint="fix it")]

    return check


def component_in(
    state: ComponentState,
    checks: dict[str, Check] | None = None,
    work: dict[str, Work] | None = None,
) -> ComponentLifecycle:
    """Return a component on a fresh machine, driven to ``state`` along the table."""
    component = ComponentLifecycle("vae", checks=checks or passing_checks(), work=work)
    LifecycleMachine().add_component(component)
    path = {
        ComponentState.CONFIGURED: [],
        ComponentState.ADMITTED: ["admit"],
        ComponentState.LOADED: ["admit", "load"],
        ComponentState.RESIDENT: ["admit", "load", "onload"],
        ComponentState.OFFLOADED: ["admit", "load", "offload"],
        ComponentState.RELEASED: ["release"],
    }[state]
    for trigger in path:
        component.trigger(trigger)
    assert component.state is state
    return component


CASES = [(state, trigger) for state in ComponentState for trigger in TRIGGERS]


class TestTransitionTable:
    @pytest.mark.parametrize(("state", "trigger"), CASES)
    def test_every_trigger_from_every_state(self, state: ComponentState, trigger: str) -> None:
        """A valid trigger reaches its destination; an invalid one changes nothing."""
        component = component_in(state)
        (rule,) = (r for r in TRANSITIONS if r.trigger == trigger)
        if state in rule.sources:
            assert getattr(component, trigger)() is True
            assert component.state is rule.dest
        else:
            with pytest.raises(InvalidTransition) as err:
                getattr(component, trigger)()
            assert component.state is state
            assert err.value.source is state
            assert f"cannot {trigger} component 'vae' from state {state.value!r}" in str(err.value)

    def test_released_is_final(self) -> None:
        """No trigger leaves the released state, and release never targets itself."""
        assert all(ComponentState.RELEASED not in r.sources for r in TRANSITIONS)

    def test_machine_is_built_from_the_table(self) -> None:
        """The machine has exactly the table's triggers, sources, destinations and guards."""
        machine = LifecycleMachine()
        for rule in TRANSITIONS:
            transitions = machine.transitions_of(rule.trigger)
            assert sorted(t.source for t in transitions) == sorted(s.name for s in rule.sources)
            assert {t.dest for t in transitions} == {rule.dest.name}
            assert {t.guard_names for t in transitions} == {rule.guards}
        assert list(machine.events) == list(TRIGGERS)

    def test_missing_check_is_refused_at_construction(self) -> None:
        """A component without every check the table names cannot be built."""
        checks = passing_checks()
        del checks["memory_budget"]
        with pytest.raises(ValueError, match=r"lacks the checks \['memory_budget'\]"):
            ComponentLifecycle("vae", checks=checks)

    def test_may_trigger_is_a_plain_answer(self) -> None:
        """``onload.may()`` answers from the guards without moving the component."""
        component = component_in(
            ComponentState.LOADED,
            passing_checks(memory_budget=refusing("residency.memory_budget", "no room")),
        )
        assert component.onload.may() is False
        assert component.offload.may() is True
        assert component.may_trigger("offload") is True
        assert component.release.may() is True
        assert component.admit.may() is False  # not valid from loaded: would not pass
        assert component.state is ComponentState.LOADED

    def test_probes_run_the_guards_as_moves_do(self) -> None:
        """A probe hands its MoveArgs to every guard, as a move does, and runs no work."""
        seen: list[tuple[str, MoveArgs]] = []
        ran: list[str] = []

        def guard(name: str) -> Check:
            def check(context: TransitionContext) -> Iterable[Refusal]:
                seen.append((name, context.args))
                return ()

            return check

        names = ("offloadable", "use_declared", "not_in_use")
        component = component_in(
            ComponentState.RESIDENT,
            passing_checks(**{name: guard(name) for name in names}),
            work={"offload": lambda context: ran.append(context.trigger)},
        )
        eviction = MoveArgs(eviction=True)
        assert component.offload.may(eviction) is True
        assert seen == [(name, eviction) for name in names]
        assert ran == []
        assert component.state is ComponentState.RESIDENT


KINDS = (
    (ComponentLifecycle, TRANSITIONS),
    (PipelineLifecycle, PIPELINE_TRANSITIONS),
    (AdapterLifecycle, ADAPTER_TRANSITIONS),
    (WorkerLifecycle, WORKER_TRANSITIONS),
)
"""Each kind of model and the table of its machine."""


class TestTriggersAndGuards:
    @pytest.mark.parametrize(("kind", "table"), KINDS, ids=lambda k: getattr(k, "noun", ""))
    def test_each_kind_declares_the_triggers_of_its_table(
        self, kind: type[Guarded], table: Sequence[TransitionRule[Any]]
    ) -> None:
        """A kind of model declares exactly its table's triggers, in the table's order."""
        assert kind.rules is table
        assert triggers_of(kind) == tuple(dict.fromkeys(rule.trigger for rule in table))

    def test_every_guard_is_named_by_a_table(self) -> None:
        """``Guard`` spells each guard and postcondition the tables name, and no other."""
        named = {
            guard
            for _, table in KINDS
            for rule in table
            for guard in (*rule.guards, rule.postcondition)
            if guard is not None
        }
        assert named == set(Guard)
        assert all(type(guard) is Guard for guard in named)

    def test_the_machine_binds_nothing_onto_its_models(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A model's triggers are its class's; attaching it adds no attribute and logs nothing."""
        component = ComponentLifecycle("c", checks=passing_checks())
        before = set(vars(component))
        with caplog.at_level("DEBUG", logger="transitions"):
            LifecycleMachine().add_component(component)
        assert set(vars(component)) - before == {"machine", "state"}
        assert caplog.records == []
        assert component.load.may() is False  # configured: only admit is valid

    def test_a_model_on_no_machine_says_so(self) -> None:
        """Firing a trigger of a model that joined no machine names the model and the fix."""
        component = ComponentLifecycle("c", checks=passing_checks())
        with pytest.raises(RuntimeError, match="component 'c' is on no machine"):
            component.admit()


class TestRefusals:
    def test_every_failing_guard_is_reported(self) -> None:
        """Several failing guards give all their reasons in one refusal; nothing moves."""
        checks = passing_checks(
            offloadable=refusing("residency.undeclared_use", "not offloadable"),
            not_in_use=refusing("residency.in_use", "in use by request r1"),
        )
        component = component_in(ComponentState.RESIDENT, checks)
        with capture_events() as events, pytest.raises(TransitionRefused) as err:
            component.offload()
        assert err.value.codes == ("residency.undeclared_use", "residency.in_use")
        assert [r.message for r in err.value.refusals] == [
            "not offloadable",
            "in use by request r1",
        ]
        assert err.value.source is ComponentState.RESIDENT
        assert component.state is ComponentState.RESIDENT
        (refused,) = events_named(events, "lifecycle.refused")
        assert refused["codes"] == ["residency.undeclared_use", "residency.in_use"]
        assert refused["component"] == "vae"
        assert refused["trigger"] == "offload"
        assert refused["source"] == "resident"
        assert refused["messages"] == ["not offloadable", "in use by request r1"]
        assert events_named(events, "lifecycle.transition") == []

    def test_refused_work_never_runs(self) -> None:
        """A refused transition does not start its work."""
        ran: list[str] = []
        component = component_in(
            ComponentState.LOADED,
            passing_checks(memory_budget=refusing("residency.memory_budget", "no room")),
            work={"onload": lambda context: ran.append(context.trigger)},
        )
        with pytest.raises(TransitionRefused):
            component.onload()
        assert ran == []

    def test_guards_see_the_trigger_arguments(self) -> None:
        """The MoveArgs a trigger is fired with reach the guards through the context."""
        seen: list[object] = []

        def budget(context: TransitionContext) -> Iterable[Refusal]:
            seen.append((context.source, context.dest, context.args, context.request_id))
            return ()

        component = component_in(ComponentState.LOADED, passing_checks(memory_budget=budget))
        args = MoveArgs(position=3, request_id="r7")
        component.onload(args)
        assert seen == [(ComponentState.LOADED, ComponentState.RESIDENT, args, "r7")]

    @pytest.mark.parametrize(
        "call",
        [
            lambda c: c.onload(position=3),
            lambda c: c.onload({"position": 3}),
            lambda c: c.onload(MoveArgs(), MoveArgs()),
        ],
        ids=["keywords", "a dict", "two values"],
    )
    def test_untyped_arguments_are_refused(
        self, call: Callable[[ComponentLifecycle], object]
    ) -> None:
        """A trigger fired with anything but one MoveArgs raises TypeError and does not move."""
        component = component_in(ComponentState.LOADED)
        with pytest.raises(TypeError, match=r"onload\(\) takes one MoveArgs"):
            call(component)
        assert component.state is ComponentState.LOADED


class TestAtomicWork:
    def test_work_that_raises_is_rolled_back(self) -> None:
        """Work failing half-way undoes its steps newest first and keeps the source state."""
        weights = {"device": False, "pinned": False}
        undone: list[str] = []

        def onload(context: TransitionContext) -> None:
            weights["pinned"] = True
            context.on_rollback(lambda: (undone.append("pin"), weights.update(pinned=False)))
            weights["device"] = True
            context.on_rollback(lambda: (undone.append("copy"), weights.update(device=False)))
            raise OSError("device out of memory")

        component = component_in(ComponentState.OFFLOADED, work={"onload": onload})
        with capture_events() as events, pytest.raises(TransitionFailed) as err:
            component.onload()
        assert isinstance(err.value.__cause__, OSError)
        assert "device out of memory" in str(err.value)
        assert undone == ["copy", "pin"]
        assert weights == {"device": False, "pinned": False}
        assert component.state is ComponentState.OFFLOADED
        (failed,) = events_named(events, "lifecycle.failed")
        assert failed["error"] == "device out of memory"

    def test_breached_postcondition_fails_and_rolls_back(self) -> None:
        """A postcondition refusal after the work fails the transition with that code."""
        built: list[str] = []

        def load(context: TransitionContext) -> None:
            built.append("module")
            context.on_rollback(built.clear)

        component = component_in(
            ComponentState.ADMITTED,
            passing_checks(
                plan_honoured=refusing("attention.backend_not_consumed", "no layer built")
            ),
            work={"load": load},
        )
        with pytest.raises(TransitionFailed) as err:
            component.load()
        cause = err.value.__cause__
        assert isinstance(cause, TransitionRefused)
        assert cause.codes == ("attention.backend_not_consumed",)
        assert built == []
        assert component.state is ComponentState.ADMITTED

    def test_broken_undo_does_not_stop_the_others(self) -> None:
        """Every undo runs even when one raises, and the failure notes it."""
        undone: list[str] = []

        def work(context: TransitionContext) -> None:
            context.on_rollback(lambda: undone.append("first"))
            context.on_rollback(_raise(RuntimeError("undo broke")))
            raise OSError("boom")

        component = component_in(ComponentState.CONFIGURED, work={"admit": work})
        with pytest.raises(TransitionFailed) as err:
            component.admit()
        assert undone == ["first"]
        assert any("undo broke" in note for note in err.value.__cause__.__notes__)  # type: ignore[union-attr]
        assert component.state is ComponentState.CONFIGURED


def _raise(error: Exception) -> Callable[[], None]:
    def undo() -> None:
        raise error

    return undo


class TestTransitionEvents:
    def test_transition_event_has_the_contract_fields(self) -> None:
        """Each transition logs component, trigger, source, dest, duration and request id."""
        component = component_in(ComponentState.LOADED)
        with (
            capture_events() as events,
            structlog.contextvars.bound_contextvars(request_id="r7"),
        ):
            component.onload()
        (event,) = events_named(events, "lifecycle.transition")
        assert event["component"] == "vae"
        assert event["trigger"] == "onload"
        assert (event["source"], event["dest"]) == ("loaded", "resident")
        assert event["request_id"] == "r7"
        assert isinstance(event["duration_ms"], float)
        assert event["duration_ms"] >= 0

    def test_request_id_is_null_outside_a_request(self) -> None:
        """Outside a request the transition event still carries request_id, as null."""
        component = component_in(ComponentState.CONFIGURED)
        with capture_events() as events:
            component.admit()
        (event,) = events_named(events, "lifecycle.transition")
        assert event["request_id"] is None


class TestSerialisation:
    def test_triggers_from_many_threads_never_overlap(self) -> None:
        """Triggers fired from eight threads run one at a time on the machine's lock."""
        in_flight: list[int] = []
        overlaps: list[int] = []

        def move(context: TransitionContext) -> None:
            in_flight.append(1)
            if len(in_flight) > 1:
                overlaps.append(len(in_flight))
            time.sleep(0.0005)
            in_flight.pop()

        machine = LifecycleMachine()
        components = []
        for index in range(4):
            component = ComponentLifecycle(
                f"c{index}", checks=passing_checks(), work={"onload": move, "offload": move}
            )
            machine.add_component(component)
            component.admit()
            component.load()
            components.append(component)

        def churn(component: ComponentLifecycle) -> None:
            for _ in range(25):
                with machine.lock:
                    if component.state is ComponentState.RESIDENT:
                        component.offload()
                    else:
                        component.onload()

        threads = [threading.Thread(target=churn, args=(components[i % 4],)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert overlaps == []
        assert all(
            c.state in (ComponentState.RESIDENT, ComponentState.OFFLOADED) for c in components
        )
