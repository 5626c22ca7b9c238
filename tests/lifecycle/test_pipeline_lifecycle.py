"""The pipeline lifecycle: its table and machine, and Orchestrator.sleep() / wake(); the
serving worker's own machine."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import pytest
import torch

from attention import Platform
from lifecycle.device.shared import SharedDevice
from lifecycle.events import PipelineSlept, PipelineWoke
from lifecycle.machines.engine import Check, TransitionContext
from lifecycle.machines.pipeline import PipelineLifecycle, PipelineMachine
from lifecycle.machines.tables import (
    PIPELINE_TRANSITIONS,
    WORKER_TRANSITIONS,
    ComponentState,
    PipelineState,
    WorkerState,
)
from lifecycle.machines.worker import WorkerMachine
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import InvalidTransition, Refusal, RefusalCode, TransitionRefused
from lifecycle.testing import EventRecorder
from tests.lifecycle.conftest import T2iPipeline
from tests.lifecycle.test_shared_device import generate

PINNED = {"residency": "resident"}


def pipeline_in(state: PipelineState, **checks: Check) -> PipelineLifecycle:
    """Return a pipeline on a fresh machine, driven to ``state`` along the table."""
    needed = {g for rule in PIPELINE_TRANSITIONS for g in rule.guards}
    all_checks: dict[str, Check] = {name: lambda context: () for name in needed}
    all_checks.update(checks)
    pipeline = PipelineLifecycle("p", checks=all_checks)
    PipelineMachine("pipelines").add_pipeline(pipeline)
    path = {
        PipelineState.SERVING: [],
        PipelineState.SLEEPING: ["sleep"],
        PipelineState.SWAPPING: ["swap"],
        PipelineState.DRAINING: ["drain"],
        PipelineState.RELEASED: ["drain", "release"],
    }[state]
    for trigger in path:
        pipeline.trigger(trigger)
    return pipeline


class TestPipelineMachine:
    @pytest.mark.parametrize(
        ("rule", "source"),
        [(rule, source) for rule in PIPELINE_TRANSITIONS for source in rule.sources],
        ids=lambda value: getattr(value, "trigger", getattr(value, "value", "")),
    )
    def test_every_row_moves_its_source_to_its_dest(
        self, rule: object, source: PipelineState
    ) -> None:
        """Each (source, trigger) of the table leads to the row's destination."""
        pipeline = pipeline_in(source)
        pipeline.trigger(rule.trigger)
        assert pipeline.state is rule.dest

    def test_a_trigger_not_valid_from_here(self) -> None:
        """Sleep while sleeping is InvalidTransition naming where sleep is valid from."""
        pipeline = pipeline_in(PipelineState.SLEEPING)
        with pytest.raises(InvalidTransition) as err:
            pipeline.sleep()
        assert str(err.value) == (
            "cannot sleep pipeline 'p' from state 'sleeping'; sleep is valid from: serving"
        )
        assert pipeline.state is PipelineState.SLEEPING

    def test_a_guard_that_says_no_leaves_the_state(self) -> None:
        """A refusing guard raises every reason, and the pipeline stays where it was."""

        def busy(context: TransitionContext) -> Iterable[Refusal]:
            return [Refusal(code=RefusalCode.IN_USE, component="p", message="busy", hint="wait")]

        pipeline = pipeline_in(PipelineState.SERVING, requests_ended=busy)
        with pytest.raises(TransitionRefused) as err:
            pipeline.sleep()
        assert err.value.codes == (RefusalCode.IN_USE,)
        assert pipeline.state is PipelineState.SERVING


class TestWorkerMachine:
    @pytest.mark.parametrize(
        ("rule", "source"),
        [(rule, source) for rule in WORKER_TRANSITIONS for source in rule.sources],
        ids=lambda value: getattr(value, "trigger", getattr(value, "value", "")),
    )
    def test_every_row_moves_its_source_to_its_dest(
        self, rule: object, source: WorkerState
    ) -> None:
        """Each (source, trigger) of the worker's table leads to the row's destination."""
        worker = WorkerMachine("worker").lifecycle("w")
        if source is not WorkerState.STARTING:
            worker.trigger("ready" if source is WorkerState.READY else "fail")
        worker.trigger(rule.trigger)
        assert worker.state is rule.dest

    def test_a_draining_worker_cannot_turn_ready(self) -> None:
        """Ready after a drain (a load that finished late) is InvalidTransition; it drains on."""
        worker = WorkerMachine("worker").lifecycle("w")
        worker.drain()
        with pytest.raises(InvalidTransition) as err:
            worker.ready()
        assert "valid from: starting" in str(err.value)
        assert worker.state is WorkerState.DRAINING


class TestSleepAndWake:
    def test_sleep_offloads_everything_and_wake_puts_it_back(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """Asleep, even the pinned DiT is off and onloads are refused with pipeline.asleep;
        awake, it is back and outputs are as before."""
        seen = EventRecorder()
        with Orchestrator(t2i_pipeline("a", transformer=PINNED), platform=cpu, observer=seen) as a:
            a.load()
            before = generate(a)
            a.sleep()
            assert a.pipeline_state is PipelineState.SLEEPING
            assert {a.state(n) for n in a.spec.components} == {ComponentState.OFFLOADED}
            assert a.resident_bytes() == 0
            with pytest.raises(TransitionRefused) as err:
                generate(a)
            assert err.value.codes == (RefusalCode.PIPELINE_ASLEEP,)
            a.wake()
            assert a.state("transformer") is ComponentState.RESIDENT
            assert torch.equal(generate(a), before)
        assert [type(e) for e in seen.events if isinstance(e, PipelineSlept | PipelineWoke)] == [
            PipelineSlept,
            PipelineWoke,
        ]

    def test_sleep_waits_for_a_request_in_flight(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """A sleep asked while a request runs a stage waits for it, never cuts it."""
        with Orchestrator(t2i_pipeline("a"), platform=cpu) as a:
            a.load()
            inside, finish = threading.Event(), threading.Event()
            stages: list[str] = []

            def run() -> None:
                with a.request("long") as request, request.stage("denoise"):
                    inside.set()
                    finish.wait(60)
                    stages.append("denoise")

            runner = threading.Thread(target=run)
            runner.start()
            inside.wait(60)
            errors: list[BaseException] = []
            sleeper = threading.Thread(target=lambda: _catch(errors, a.sleep))
            sleeper.start()
            assert a.component("transformer").in_use_by == ("long",)
            assert a.pipeline_state is PipelineState.SERVING
            finish.set()
            runner.join(60)
            sleeper.join(60)
            assert (stages, errors) == (["denoise"], [])
            assert a.pipeline_state is PipelineState.SLEEPING

    def test_sleep_is_refused_when_requests_outlast_the_timeout(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """A request still open after the timeout refuses the sleep; nothing moved."""
        with Orchestrator(t2i_pipeline("a"), platform=cpu) as a:
            a.load()
            with a.request("open"), pytest.raises(TransitionRefused) as err:
                a.sleep(timeout=0)
            (refusal,) = err.value.refusals
            assert refusal.code is RefusalCode.IN_USE
            assert refusal.message == "pipeline 'a' has open request(s) open"
            assert a.pipeline_state is PipelineState.SERVING
            assert a.state("transformer") is ComponentState.RESIDENT

    def test_a_component_an_awake_pipeline_shares_stays(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """Sleeping one user of a pinned shared encoder leaves it resident for the other;
        it leaves once both sleep, and comes back with the first to wake."""
        device = SharedDevice()
        a = Orchestrator(t2i_pipeline("a", text_encoder=PINNED), platform=cpu, shared=device)
        b = Orchestrator(t2i_pipeline("b", 5, text_encoder=PINNED), platform=cpu, shared=device)
        a.load()
        b.load()
        a.sleep()
        assert (a.state("transformer"), b.state("text_encoder")) == (
            ComponentState.OFFLOADED,
            ComponentState.RESIDENT,
        )
        generate(b)
        b.sleep()
        assert b.state("text_encoder") is ComponentState.OFFLOADED
        a.wake()
        assert a.state("text_encoder") is ComponentState.RESIDENT
        assert b.state("transformer") is ComponentState.OFFLOADED
        a.close()
        b.close()

    def test_a_wake_the_budget_cannot_hold_is_refused(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """A large DiT cannot wake beside another pipeline's pinned one: refused with the
        numbers, still asleep."""
        device = SharedDevice(device_budget=1_300_000)
        a = Orchestrator(
            t2i_pipeline("a", transformer={"options": {"seed": 2, "dim": 96}}),
            platform=cpu,
            shared=device,
        )
        a.load()
        a.sleep()
        b = Orchestrator(t2i_pipeline("b", 5, transformer=PINNED), platform=cpu, shared=device)
        b.load()
        with pytest.raises(TransitionRefused) as err:
            a.wake()
        (refusal,) = err.value.refusals
        assert refusal.code is RefusalCode.MEMORY_BUDGET
        assert refusal.message.startswith("stage 'wake()' needs 1.3 MiB on device at once")
        assert a.pipeline_state is PipelineState.SLEEPING
        b.close()
        a.wake()
        assert a.state("transformer") is ComponentState.RESIDENT
        a.close()

    def test_slept_before_load_it_loads_asleep(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """A pipeline put to sleep before load() loads every component offloaded."""
        with Orchestrator(t2i_pipeline("a", transformer=PINNED), platform=cpu) as a:
            a.sleep()
            a.load()
            assert a.state("transformer") is ComponentState.OFFLOADED
            a.wake()
            assert a.state("transformer") is ComponentState.RESIDENT

    def test_close_releases_a_sleeping_pipeline(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """Closing drains and releases a sleeping pipeline; closing again changes nothing."""
        a = Orchestrator(t2i_pipeline("a"), platform=cpu)
        a.load()
        a.sleep()
        a.close()
        a.close()
        assert a.pipeline_state is PipelineState.RELEASED
        assert {a.state(n) for n in a.spec.components} == {ComponentState.RELEASED}


def _catch(errors: list[BaseException], action: object) -> None:
    """Run ``action``; keep what it raised."""
    try:
        action()  # type: ignore[operator]
    except BaseException as err:
        errors.append(err)
