"""Waiting for memory (design §5.5): FIFO turns, a bounded wait, no deadlock."""

from __future__ import annotations

import io
import itertools
import threading
from collections import Counter
from collections.abc import Callable

import pytest
import structlog

from attention import Platform
from lifecycle.device.waiting import LEAD
from lifecycle.events import MemoryWait, Move, TriggerRefused
from lifecycle.logs import configure_logging
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import TransitionRefused
from lifecycle.testing import EventRecorder, capture_events, events_named
from tests.lifecycle.conftest import VAE_BYTES, VaePipeline
from tests.lifecycle.test_requests import NEXT_USES

WATCHDOG_S = 120.0
"""How long any thread of these tests may take before the test fails as a deadlock."""


def until(condition: Callable[[], bool]) -> None:
    """Block until ``condition`` holds (checked every 5 ms), failing after the watchdog."""
    done = threading.Event()
    for _ in range(int(WATCHDOG_S / 0.005)):
        if condition():
            return
        done.wait(0.005)
    raise AssertionError("condition never held: the watchdog fired")


def run_threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Run each target on its own thread; return their errors; fail if one never ends."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as err:  # re-raised by the caller, in the main thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WATCHDOG_S)
    assert not any(t.is_alive() for t in threads), "deadlock: a request never finished"
    return errors


def wait_behind(orch: Orchestrator) -> tuple[list[BaseException], list[str]]:
    """Run r1 in stage s0 while r2 waits for s1; let r1 go once r2 queues.

    Return the requests' errors, and who entered a stage, in order.
    """
    release = threading.Event()
    entered: list[str] = []

    def holder() -> None:
        with orch.request("r1") as request, request.stage("s0"):
            entered.append("r1")
            release.wait(WATCHDOG_S)

    def waiter() -> None:
        until(lambda: entered == ["r1"])
        with orch.request("r2") as request, request.stage("s1"):
            entered.append("r2")

    def releaser() -> None:
        until(lambda: orch.waiter.queue == ("r2",))
        assert entered == ["r1"]  # r2 is waiting, not refused and not running
        release.set()

    return run_threads([holder, waiter, releaser]), entered


def queue_behind(
    orch: Orchestrator, stages: dict[str, str]
) -> tuple[list[BaseException], list[str]]:
    """Run r1 in stage s0 while each request of ``stages`` queues for its stage, in
    order; let r1 go once they all wait.

    Return the requests' errors, and who entered a stage, in order.
    """
    release = threading.Event()
    entered: list[str] = []
    order = tuple(stages)

    def holder() -> None:
        with orch.request("r1") as request, request.stage("s0"):
            entered.append("r1")
            release.wait(WATCHDOG_S)

    def queued(index: int) -> Callable[[], None]:
        def run() -> None:
            until(lambda: entered == ["r1"] and orch.waiter.queue == order[:index])
            rid = order[index]
            with orch.request(rid) as request, request.stage(stages[rid]):
                entered.append(rid)

        return run

    def releaser() -> None:
        until(lambda: orch.waiter.queue == order)
        release.set()

    return run_threads([holder, *(queued(i) for i in range(len(order))), releaser]), entered


class TestWaiting:
    def test_blocked_onload_waits_for_the_holder(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """A stage that fits only once another request lets go waits, then runs; no refusal."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        observed = EventRecorder()
        with (
            Orchestrator(spec, platform=cpu, observer=observed) as orch,
            capture_events() as events,
        ):
            orch.load()
            errors, entered = wait_behind(orch)
            assert errors == []
        assert entered == ["r1", "r2"]
        (waited,) = events_named(events, "residency.waited")
        assert (waited["request_id"], waited["stage"], waited["components"]) == ("r2", "s1", ["b"])
        assert waited["outcome"] == "acquired"
        (wait,) = observed.of(MemoryWait)
        assert (wait.request_id, wait.stage, wait.components) == ("r2", "s1", ("b",))
        assert (wait.outcome, wait.seconds) == ("acquired", waited["seconds"])

    def test_turns_are_first_come_first_served(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """Requests blocked on memory that need a move enter in the order they started
        waiting."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()
            errors, entered = queue_behind(orch, {"r2": "s1", "r3": "s2", "r4": "s2"})
        assert errors == []
        assert entered == ["r1", "r2", "r3", "r4"]

    def test_the_line_says_who_joins_and_leaves_it(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """The waiter's listeners hear every request that joins the line or leaves it,
        with the lock held: r3 joins behind r2 without an attempt, so no event says it."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()
            lines: list[tuple[str, ...]] = []
            orch.waiter.on_change(lambda: lines.append(orch.waiter.queue))
            errors, entered = queue_behind(orch, {"r2": "s1", "r3": "s2"})
        assert errors == []
        assert entered == ["r1", "r2", "r3"]
        assert lines == [("r2",), ("r2", "r3"), ("r3",), ()]

    def test_a_stage_on_resident_components_goes_first(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """A waiting stage whose component stayed resident (b, used again at s4) goes ahead
        of an older one that needs a move, and b is onloaded once for both."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        observed = EventRecorder()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            observed.clear()
            errors, entered = queue_behind(orch, {"r2": "s1", "r3": "s2", "r4": "s1"})
        assert errors == []
        assert entered == ["r1", "r2", "r4", "r3"]
        onloads = [m.component for m in observed.of(Move) if m.direction == "onload"]
        assert onloads == ["a", "b", "c"]

    def test_wait_is_bounded_and_names_the_holders(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """Past memory.wait_timeout the request is refused, naming who holds what."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=0.2)
        observed = EventRecorder()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            with orch.request("r1") as first, first.stage("s0"):
                with (
                    pytest.raises(TransitionRefused) as err,
                    orch.request("r2") as second,
                    second.stage("s1"),
                ):
                    pass
                assert err.value.codes == ("residency.memory_budget",)
                message = err.value.refusals[0].message
                assert "waited 0.2 s for memory for stage components b" in message
                assert "request r1 holds a" in message
                assert "raise memory.wait_timeout" in err.value.refusals[0].hint
                assert orch.waiter.queue == ()
                (wait,) = observed.of(MemoryWait)
                assert (wait.request_id, wait.stage, wait.outcome) == ("r2", "s1", "refused")
                assert wait.seconds >= 0.2
            assert orch.component("b").in_use_by == ()

    def test_only_a_stage_attempt_is_marked_as_possibly_waiting(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """Refusals of a stage's onload attempts carry may_wait; a manual onload's does not."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=0.05)
        observed = EventRecorder()
        with (
            Orchestrator(spec, platform=cpu, observer=observed) as orch,
            capture_events() as events,
        ):
            orch.load()
            with orch.request("r1") as first, first.stage("s0"):
                with (
                    pytest.raises(TransitionRefused),
                    orch.request("r2") as second,
                    second.stage("s1"),
                ):
                    pass
                with pytest.raises(TransitionRefused):
                    orch.onload("b")
            assert structlog.contextvars.get_contextvars() == {}  # nothing stays bound
        *attempts, manual = events_named(events, "lifecycle.refused")
        assert attempts
        assert {(e["request_id"], e.get("may_wait")) for e in attempts} == {("r2", True)}
        assert (manual["request_id"], manual.get("may_wait")) == ("r1", None)
        assert manual["codes"] == ["residency.memory_budget"]
        *typed, typed_manual = observed.of(TriggerRefused)
        assert {(r.request_id, r.may_wait) for r in typed} == {("r2", True)}
        assert (typed_manual.request_id, typed_manual.may_wait) == ("r1", False)

    def test_nested_stage_does_not_wait(self, cpu: Platform, vae_pipeline: VaePipeline) -> None:
        """A request that already holds a stage is refused at once: it never holds and waits."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        observed = EventRecorder()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            with orch.request("r1") as request, request.stage("s0"):
                with pytest.raises(TransitionRefused) as err, request.stage("s1"):
                    pass
                assert "waited" not in err.value.refusals[0].message
                assert observed.of(MemoryWait) == []


T2I = {"encode": ["a"], "denoise": ["b"], "decode": ["c"]}
"""Three offloaded VAEs in the stages of a text-to-image pipeline."""


def hold(orch: Orchestrator, rid: str, stage: str, entered: list[str]) -> Callable[[], None]:
    """Enter ``stage`` of a new request ``rid`` on a thread and stay in it; return once it
    is in, with what lets it go and waits until its request has ended."""
    gate = threading.Event()

    def run() -> None:
        with orch.request(rid) as request, request.stage(stage):
            entered.append(rid)
            gate.wait(WATCHDOG_S)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    until(lambda: rid in entered)

    def let_go() -> None:
        gate.set()
        thread.join(WATCHDOG_S)
        assert not thread.is_alive()

    return let_go


class TestResidentFirst:
    def test_requests_waiting_for_one_component_move_it_once(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """Six requests waiting to encode while two others denoise and decode under a
        budget of two components make 4 moves in all, not 2 for each of them."""
        spec = vae_pipeline(2 * VAE_BYTES + 1000, T2I, wait_timeout=60.0)
        observed = EventRecorder()
        entered: list[str] = []
        waiting = [f"q{i}" for i in range(6)]
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            denoising = hold(orch, "r0", "denoise", entered)
            decoding = hold(orch, "r1", "decode", entered)
            observed.clear()

            def encode(index: int) -> Callable[[], None]:
                def run() -> None:
                    until(lambda: orch.waiter.queue == tuple(waiting[:index]))
                    with orch.request(waiting[index]) as request, request.stage("encode"):
                        entered.append(waiting[index])

                return run

            def releaser() -> None:
                until(lambda: orch.waiter.queue == tuple(waiting))
                decoding()

            errors = run_threads([encode(i) for i in range(len(waiting))] + [releaser])
            denoising()
        assert errors == []
        assert entered[:2] == ["r0", "r1"]
        assert sorted(entered[2:]) == waiting  # once a is on, they go at once, in any order
        moves = Counter((m.component, m.direction) for m in observed.of(Move))
        assert moves == {
            ("c", "offload"): 1,  # the decode ended: the encoders need its room
            ("a", "onload"): 1,  # once for the six
            ("a", "offload"): 1,
            ("b", "offload"): 1,  # the denoise ended
        }

    def test_resident_stages_go_ahead_by_the_lead_and_no_further(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """While an encode waits for room, LEAD decodes on the resident decoder go ahead of
        it without waiting; the next one waits behind it, so that it cannot starve."""
        spec = vae_pipeline(2 * VAE_BYTES + 1000, T2I, wait_timeout=60.0)
        observed = EventRecorder()
        entered: list[str] = []
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            denoising = hold(orch, "r0", "denoise", entered)
            decoding = hold(orch, "r1", "decode", entered)

            def stage(rid: str, name: str) -> Callable[[], None]:
                def run() -> None:
                    with orch.request(rid) as request, request.stage(name):
                        entered.append(rid)

                return run

            threads = [threading.Thread(target=stage("w", "encode"), daemon=True)]
            threads[0].start()
            until(lambda: orch.waiter.queue == ("w",))

            def settled(rid: str) -> bool:
                """Tell whether ``rid`` entered or waits (under the lock: a request is in
                the queue outside it only while it waits)."""
                with orch.shared.lock:
                    return rid in entered or rid in orch.waiter.queue

            for index in range(LEAD + 1):
                rid = f"n{index}"
                threads.append(threading.Thread(target=stage(rid, "decode"), daemon=True))
                threads[-1].start()
                until(lambda: settled(rid))  # noqa: B023
            assert entered == ["r0", "r1", *(f"n{i}" for i in range(LEAD))]
            assert orch.waiter.queue == ("w", f"n{LEAD}")
            decoding()
            denoising()
            for thread in threads:
                thread.join(WATCHDOG_S)
            assert not any(thread.is_alive() for thread in threads)
        assert entered[-2:] == ["w", f"n{LEAD}"]
        assert [wait.request_id for wait in observed.of(MemoryWait)] == ["w", f"n{LEAD}"]


PAIRS = {"ab": ["a", "b"], "bc": ["b", "c"], "ca": ["c", "a"]}
"""Three offloaded VAEs, each stage using two of them."""


class TestNoDeadlock:
    def test_mixed_stage_orders_under_a_tight_budget(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """Six threads walk overlapping two-component stages in every order: all finish."""
        budget = 2 * VAE_BYTES + 1000  # exactly one stage at a time
        spec = vae_pipeline(budget, PAIRS)
        observed = EventRecorder()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            orders = list(itertools.permutations(("ab", "bc", "ca")))

            def walk(index: int, order: tuple[str, ...]) -> Callable[[], None]:
                def run() -> None:
                    for repeat in range(3):
                        with orch.request(f"t{index}-{repeat}") as request:
                            for stage in order:
                                with request.stage(stage):
                                    assert orch.resident_bytes() <= budget

                return run

            errors = run_threads([walk(i, order) for i, order in enumerate(orders)])
            assert errors == []
            assert all(orch.component(n).in_use_by == () for n in ("a", "b", "c"))
        onloads = [m for m in observed.of(Move) if m.direction == "onload"]
        assert len(onloads) >= len(orders) * 3 * 2  # they really moved under the budget


class BreaksOn(io.StringIO):
    """A log stream whose write fails, as a closed pipe's does, for the lines naming ``event``."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event = event
        self.failures = 0

    def write(self, text: str) -> int:
        """Write ``text``, or raise BrokenPipeError when it names the event."""
        if self.event in text:
            self.failures += 1
            raise BrokenPipeError(f"the log stream broke writing {self.event}")
        return super().write(text)


@pytest.fixture
def break_log() -> Callable[[str], BreaksOn]:
    """Log JSON lines at info onto a stream that breaks on one event (``process_state``
    puts the logging back after the test)."""

    def configure(event: str) -> BreaksOn:
        stream = BreaksOn(event)
        configure_logging("json", "info", stream)
        return stream

    return configure


class TestBrokenLogStream:
    def test_an_unwritable_wait_event_leaves_nothing_in_use(
        self,
        cpu: Platform,
        vae_pipeline: VaePipeline,
        break_log: Callable[[str], BreaksOn],
    ) -> None:
        """A wait whose event cannot be written keeps no stage: later requests run, close works."""
        broken = break_log("residency.waited")
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        orch = Orchestrator(spec, platform=cpu)
        orch.load()
        errors, entered = wait_behind(orch)
        assert broken.failures == 1  # the fault happened, where the stage was taken
        assert all(isinstance(err, BrokenPipeError) for err in errors), errors
        assert all(orch.component(name).in_use_by == () for name in ("a", "b", "c"))
        with orch.request("r3") as request:
            for stage in ("s0", "s1", "s2"):
                with request.stage(stage):
                    entered.append(stage)
        assert entered[-3:] == ["s0", "s1", "s2"]
        orch.close()  # raises an ExceptionGroup when a component is still in use
        assert all(orch.state(name) is ComponentState.RELEASED for name in ("a", "b", "c"))

    def test_an_unwritable_begin_event_leaves_no_request_open(
        self,
        cpu: Platform,
        vae_pipeline: VaePipeline,
        break_log: Callable[[str], BreaksOn],
    ) -> None:
        """A request whose first event cannot be written does not stay open under its id."""
        broken = break_log("request.begin")
        with Orchestrator(vae_pipeline(VAE_BYTES + 1000, NEXT_USES), platform=cpu) as orch:
            orch.load()
            for _ in range(2):  # an id left open would make the second a ValueError
                with pytest.raises(BrokenPipeError), orch.request("r1"):
                    pass
            assert broken.failures == 2
