"""Components built in parallel threads at load: the same result as one at a time, sooner."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from attention import Platform
from components import registry as kinds
from lifecycle.events import Transitioned
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import TransitionFailed
from lifecycle.spec.structs import PipelineSpec
from lifecycle.testing import EventRecorder
from tests.lifecycle.conftest import ReferenceSpec
from tests.lifecycle.kinds_for_tests import PlainGenericKind
from tests.lifecycle.test_requests import generate

NAMES = ("text_encoder", "transformer", "vae")


def with_options(spec: PipelineSpec, name: str, **options: object) -> PipelineSpec:
    """Return ``spec`` with component ``name``'s options updated."""
    components = dict(spec.components)
    merged = {**components[name].options, **options}
    components[name] = msgspec.structs.replace(components[name], options=merged)
    return msgspec.structs.replace(spec, components=components)


def dit_weights(path: Path) -> Path:
    """Write the default tiny_dit's seeded weights to ``path``; return it."""
    module = kinds.get("tiny_dit").from_options({}).build("custom")
    save_file(dict(module.state_dict()), str(path))
    return path


def load_threads() -> list[threading.Thread]:
    """Return the live threads that build components ahead of their load."""
    return [t for t in threading.enumerate() if t.name.startswith("load")]


class TestParallelLoad:
    def test_parallel_builds_equal_one_at_a_time(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """With the host target every component is built in a thread; weights, places and a
        request's image equal those of a load one at a time, and the load transitions still
        run in spec order."""
        recorder = EventRecorder()
        with (
            Orchestrator(reference_spec(), platform=cpu, observer=recorder) as parallel,
            Orchestrator(reference_spec(), platform=cpu, load_threads=1) as sequential,
        ):
            report = parallel.load()
            alone = sequential.load()
            for name in NAMES:
                assert parallel.state(name) is sequential.state(name)
                for (key, a), (_, b) in zip(
                    parallel.module(name).state_dict().items(),
                    sequential.module(name).state_dict().items(),
                    strict=True,
                ):
                    assert torch.equal(a, b), (name, key)
            assert torch.equal(generate(parallel, 5), generate(sequential, 5))
        assert report.parallel == NAMES
        assert alone.parallel == ()
        assert set(report.components) == set(NAMES)
        assert all(ms > 0 for ms in report.components.values())
        loads = [e.component for e in recorder.of(Transitioned) if e.trigger == "load"]
        assert loads == list(NAMES)
        assert load_threads() == []

    def test_disk_offloaded_components_are_built_one_at_a_time(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """With the disk target only the resident components build together: the host
        memory check counts disk-offloaded ones one at a time."""
        spec = reference_spec("disk", text_encoder={"residency": "resident"})
        with Orchestrator(spec, platform=cpu) as orchestrator:
            report = orchestrator.load()
        assert report.parallel == ("text_encoder", "transformer")
        assert set(report.components) == set(NAMES)

    def test_weights_drawn_by_a_builder_keep_the_load_sequential(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A component whose weights are neither a file nor a seed draws from torch's global
        generator: the whole load stays in order, as reproducible as before."""
        spec = reference_spec()
        extra = msgspec.convert({"kind": PlainGenericKind.kind}, type(spec.components["vae"]))
        generic = msgspec.structs.replace(spec, components={**spec.components, "extra": extra})
        kinds.register_kind(PlainGenericKind)
        try:
            with Orchestrator(generic, platform=cpu) as orchestrator:
                report = orchestrator.load()
        finally:
            kinds.unregister_kind(PlainGenericKind.kind)
        assert report.parallel == ()
        assert set(report.components) == {*NAMES, "extra"}

    def test_a_failed_build_fails_its_own_transition_only(
        self, reference_spec: ReferenceSpec, cpu: Platform, tmp_path: Path
    ) -> None:
        """A weights file gone after admission fails the DiT's load as a sequential load
        would: the encoder before it is placed, the DiT and the VAE after it stay ADMITTED,
        no build thread is left, and a second load() finishes once the file is back."""
        weights = dit_weights(tmp_path / "dit.safetensors")
        spec = with_options(reference_spec(), "transformer", weights=str(weights))
        with Orchestrator(spec, platform=cpu) as orchestrator:
            orchestrator.admit()
            kept = weights.read_bytes()
            weights.unlink()
            with pytest.raises(TransitionFailed) as failed:
                orchestrator.load()
            states = [orchestrator.state(name) for name in NAMES]
            threads = load_threads()
            weights.write_bytes(kept)
            report = orchestrator.load()
            final = [orchestrator.state(name) for name in NAMES]
        assert failed.value.component == "transformer"
        assert isinstance(failed.value.__cause__, FileNotFoundError)
        assert states == [
            ComponentState.OFFLOADED,
            ComponentState.ADMITTED,
            ComponentState.ADMITTED,
        ]
        assert threads == []
        assert report.parallel == ("transformer", "vae")
        assert final == [
            ComponentState.OFFLOADED,
            ComponentState.RESIDENT,
            ComponentState.OFFLOADED,
        ]
