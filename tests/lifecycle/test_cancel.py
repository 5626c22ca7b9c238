"""``Request.cancel()`` in the embedded API (design §15): the request stops at the next
denoising step, or before its next stage, or leaves the memory queue; every component
it used is back where its plan says, idle, and armed only if resident."""

from __future__ import annotations

import threading

import pytest
import torch

from attention import Attention, Platform
from components.batch import Batch, Cancelled, StepDone
from lifecycle.events import MemoryWait, Move, RequestCancelled
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.requests import Request
from lifecycle.testing import EventRecorder, capture_events, events_named
from tests.lifecycle.conftest import VAE_BYTES, ReferenceSpec, VaePipeline
from tests.lifecycle.test_requests import NEXT_USES
from tests.lifecycle.test_waiting import WATCHDOG_S, run_threads, until

STEPS = 6

Rest = dict[str, tuple[ComponentState, tuple[str, ...], bool]]


def image_batch() -> Batch:
    """Return a seeded request of two images with its latents given."""
    generator = torch.Generator().manual_seed(3)
    return Batch(
        generator=generator,
        steps=STEPS,
        size=2,
        prompts=["a fox", "a lighthouse"],
        latents=[torch.randn(16, 4, generator=generator) for _ in range(2)],
    )


def at_rest(orch: Orchestrator) -> Rest:
    """Return each component's state, users, and whether its attention layers are armed
    exactly when it is resident."""
    rest = {}
    for name in orch.snapshot().components:
        view = orch.component(name)
        layers = [m for m in orch.module(name).modules() if isinstance(m, Attention)]
        resident = view.state is ComponentState.RESIDENT
        rest[name] = (view.state, view.in_use_by, all(a.is_armed == resident for a in layers))
    return rest


def cancel_at(request: Request, batch: Batch, step: int) -> threading.Thread:
    """Cancel ``request`` from another thread while ``batch`` is held at ``step``."""
    reached, go = threading.Event(), threading.Event()

    def hook(done: StepDone) -> None:
        if done.step == step:
            reached.set()
            assert go.wait(WATCHDOG_S)

    def cancel() -> None:
        assert reached.wait(WATCHDOG_S)
        request.cancel()
        go.set()

    batch.on_step = hook
    thread = threading.Thread(target=cancel, daemon=True)
    thread.start()
    return thread


def enter(request: Request, stage: str) -> None:
    """Enter and leave ``stage`` of ``request``."""
    with request.stage(stage):
        pass


class TestCancel:
    def test_running_request_stops_after_the_step_it_is_in(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """Cancelled during step 2, the request stops there and leaves every component at rest."""
        observed = EventRecorder()
        with Orchestrator(reference_spec(), platform=cpu, observer=observed) as orch:
            orch.load()
            with orch.request("full") as request:
                request.run_all(image_batch())
            idle, idle_bytes = at_rest(orch), orch.resident_bytes()
            batch = image_batch()
            with capture_events() as events, orch.request("r1") as request:
                canceller = cancel_at(request, batch, 2)
                with pytest.raises(Cancelled) as stopped:
                    request.run_all(batch)
            canceller.join(WATCHDOG_S)
            assert (stopped.value.stage, stopped.value.step) == ("denoise", 2)
            assert request.stages == ["encode", "denoise"]  # decode never started
            assert at_rest(orch) == idle
            assert orch.resident_bytes() == idle_bytes
            (cancelled,) = observed.of(RequestCancelled)
            assert cancelled == RequestCancelled(request_id="r1", stage="denoise", step=2)
            (logged,) = events_named(events, "request.cancelled")
            assert (logged["stage"], logged["step"]) == ("denoise", 2)
            assert events_named(events, "request.end")[0]["request_id"] == "r1"

    def test_cancelled_between_stages_enters_no_more(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A request cancelled after a stage refuses the next one before moving anything."""
        observed = EventRecorder()
        with Orchestrator(reference_spec(), platform=cpu, observer=observed) as orch:
            orch.load()
            batch = image_batch()
            with orch.request("r1") as request:
                request.run("encode", batch)
                request.cancel()
                moves = len(observed.of(Move))
                with pytest.raises(Cancelled) as stopped:
                    request.run("denoise", batch)
                assert len(observed.of(Move)) == moves
                assert request.stages == ["encode"]
                with pytest.raises(Cancelled), request.stage("decode"):
                    pass
            assert (stopped.value.stage, stopped.value.step) == ("denoise", 0)
            assert [e.stage for e in observed.of(RequestCancelled)] == ["denoise", "decode"]
            assert all(users == () for _, users, _ in at_rest(orch).values())

    def test_cancel_while_waiting_for_memory_leaves_the_queue(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """A stage waiting for memory stops waiting when its request is cancelled."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        observed = EventRecorder()
        release = threading.Event()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            waiting: list[Request] = []

            def holder() -> None:
                with orch.request("r1") as request, request.stage("s0"):
                    release.wait(WATCHDOG_S)

            def waiter() -> None:
                until(lambda: orch.component("a").in_use_by == ("r1",))
                with orch.request("r2") as request:
                    waiting.append(request)
                    with pytest.raises(Cancelled):
                        enter(request, "s1")

            def canceller() -> None:
                until(lambda: orch.waiter.queue == ("r2",))
                waiting[0].cancel()
                until(lambda: orch.waiter.queue == ())
                release.set()

            assert run_threads([holder, waiter, canceller]) == []
            (wait,) = observed.of(MemoryWait)
            assert (wait.request_id, wait.outcome) == ("r2", "cancelled")
            assert orch.component("b").in_use_by == ()


class TestPriorityWhileWaiting:
    def test_higher_priority_waiter_goes_first(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """Stages waiting for memory that need a move enter by priority, FIFO within one
        priority."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        release = threading.Event()
        entered: list[str] = []
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()

            def holder() -> None:
                with orch.request("r1") as request, request.stage("s0"):
                    entered.append("r1")
                    release.wait(WATCHDOG_S)

            def queued(rid: str, priority: int, stage: str, after: tuple[str, ...]) -> None:
                until(lambda: entered == ["r1"] and orch.waiter.queue == after)
                with orch.request(rid, priority=priority) as request, request.stage(stage):
                    entered.append(rid)

            def releaser() -> None:
                until(lambda: orch.waiter.queue == ("high", "low1", "low2"))
                release.set()

            errors = run_threads(
                [
                    holder,
                    lambda: queued("low1", 0, "s1", ()),
                    lambda: queued("low2", 0, "s2", ("low1",)),
                    lambda: queued("high", 5, "s4", ("low1", "low2")),
                    releaser,
                ]
            )
        assert errors == []
        assert entered == ["r1", "high", "low1", "low2"]
