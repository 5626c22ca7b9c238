"""The orchestrator's observer: typed events, several observers, none that can break it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from attention import Platform
from lifecycle.events import Event, Move, RequestBegan, RequestEnded, Transitioned, TriggerRefused
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused, TransitionRefused
from lifecycle.spec.reading import load_spec
from lifecycle.testing import EventRecorder, capture_events, events_named
from tests.lifecycle.conftest import ReferenceSpec
from tests.lifecycle.test_requests import generate

ROOT = Path(__file__).resolve().parents[2]

LOGGED = {
    Move: "residency.moved",
    Transitioned: "lifecycle.transition",
    TriggerRefused: "lifecycle.refused",
    RequestBegan: "request.begin",
    RequestEnded: "request.end",
}


def serve_and_refuse(orchestrator: Orchestrator) -> None:
    """Load, run one request, then meet one refusal (a manual offload of the transformer)."""
    orchestrator.load()
    generate(orchestrator)
    with pytest.raises(TransitionRefused):
        orchestrator.offload("transformer")


def as_json(value: object) -> Any:
    """Return ``value`` as it reads back from JSON (a log line's form)."""
    return msgspec.json.decode(msgspec.json.encode(value))


class TestEvents:
    def test_every_logged_fact_is_observed_with_the_same_fields(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """Each move, transition, refusal and request event reaches the observer as its log line."""
        observed = EventRecorder()
        with (
            capture_events() as logs,
            Orchestrator(reference_spec(), platform=cpu, observer=observed) as orch,
        ):
            serve_and_refuse(orch)
        for kind, name in LOGGED.items():
            typed = [as_json(event) for event in observed.of(kind)]
            logged = events_named(logs, name)
            assert typed
            assert len(typed) == len(logged)
            for event, line in zip(typed, logged, strict=True):
                assert event.pop("type") == name  # encodes under its log event's name
                event.pop("at", None)  # a move's time since start: not in the log line
                assert event.pop("may_wait", False) is False
                assert event == as_json({key: line[key] for key in event})

    def test_admission_refusals_are_observed(self, cpu: Platform) -> None:
        """A refused admission hands one TriggerRefused per component to the observer."""
        spec = load_spec(ROOT / "examples" / "refused" / "undeclared_use.toml")
        observed = EventRecorder()
        orch = Orchestrator(spec, platform=cpu, observer=observed)
        with pytest.raises(AdmissionRefused):
            orch.admit()
        (refused,) = observed.of(TriggerRefused)
        assert (refused.trigger, refused.source) == ("admit", "configured")
        assert refused.codes == ("residency.undeclared_use",)
        assert refused.request_id is None


class TestObservers:
    def test_several_observers_and_detaching_one(self, reference_spec: ReferenceSpec) -> None:
        """Every attached observer receives every event; a detached one receives no more."""
        first, second = EventRecorder(), EventRecorder()
        with Orchestrator(reference_spec(), platform=Platform("cpu"), observer=first) as orch:
            detach = orch.observe(second)
            orch.load()
            generate(orch)
            detach()
            detach()  # a second call changes nothing
            generate(orch)
        assert len(second.of(RequestEnded)) == 1
        assert len(first.of(RequestEnded)) == 2
        assert second.events == first.events[: len(second.events)]

    def test_a_raising_observer_changes_nothing(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """An observer that raises is logged and skipped: states, moves and other observers
        are as if it were not there."""

        def broken(event: Event) -> None:
            raise RuntimeError("observer bug")

        runs = []
        for observers in ((), (broken,)):
            observed = EventRecorder()
            with (
                capture_events() as logs,
                Orchestrator(reference_spec(), platform=cpu, observer=observed) as orch,
            ):
                for observer in observers:
                    orch.observe(observer)
                serve_and_refuse(orch)
                states = {name: orch.state(name) for name in orch.spec.components}
            moves = [(m.component, m.direction, m.request_id) for m in observed.of(Move)]
            runs.append((states, moves, [type(e) for e in observed.events], logs))
        (states, moves, kinds, _), (broken_states, broken_moves, broken_kinds, logs) = runs
        assert (broken_states, broken_moves, broken_kinds) == (states, moves, kinds)
        failures = events_named(logs, "lifecycle.observer_failed")
        assert len(failures) == len(kinds)  # one for each event it was handed
        assert failures[0]["error"] == "RuntimeError: observer bug"


class TestRenamedEvent:
    def test_the_old_name_of_the_refused_event_still_imports(self) -> None:
        """``lifecycle.events.Refused``, the event's old name, is ``TriggerRefused`` with a
        DeprecationWarning; the exception ``lifecycle.Refused`` is another class."""
        import lifecycle
        from lifecycle import events

        with pytest.warns(DeprecationWarning, match="TriggerRefused"):
            old = events.Refused
        assert old is TriggerRefused
        assert lifecycle.Refused is not TriggerRefused
