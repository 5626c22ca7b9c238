"""Requests and residency: stages, in-use counts, offload targets, the budget, threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from attention import Attention, Platform
from components.batch import Batch
from lifecycle.events import Move
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import TransitionFailed, TransitionRefused
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import PipelineSpec
from lifecycle.testing import EventRecorder, capture_events, events_named
from tests.lifecycle.conftest import VAE_BYTES, ReferenceSpec, VaePipeline

STAGES = ("encode", "denoise", "decode")


def generate(orch: Orchestrator, seed: int = 0, **fields: Any) -> torch.Tensor:
    """Run one request (``fields`` set on its batch) through every stage; return its images."""
    batch = Batch(generator=torch.Generator().manual_seed(seed), steps=2, **fields)
    with orch.request() as request:
        request.run_all(batch)
    assert batch.images is not None
    return batch.images


class TestOffloadTargets:
    def test_outputs_equal_across_residency(
        self, reference_spec: ReferenceSpec, cpu: Platform, tmp_path: Path
    ) -> None:
        """Resident, host, disk and layerwise runs produce bit-identical images."""
        resident = {"residency": "resident"}
        layerwise = {"residency": "layerwise_offload", "layerwise": {"prefetch": 1}}
        configurations = {
            "resident": reference_spec(text_encoder=resident, vae=resident),
            "host": reference_spec(),
            "disk": reference_spec("disk"),
            "layerwise": reference_spec("disk", text_encoder=layerwise, transformer=layerwise),
            "layerwise host": reference_spec(text_encoder=layerwise, vae=resident),
        }
        images = {}
        for label, spec in configurations.items():
            with Orchestrator(spec, platform=cpu) as orch:
                orch.load()
                images[label] = [generate(orch, seed) for seed in (0, 1)]
        for label in ("host", "disk", "layerwise", "layerwise host"):
            for got, want in zip(images[label], images["resident"], strict=True):
                assert torch.equal(got, want), label

    def test_disk_offload_frees_the_weights(
        self, reference_spec: ReferenceSpec, cpu: Platform, tmp_path: Path
    ) -> None:
        """Offloaded to disk, every tensor is an empty placeholder and the file holds it all."""
        with Orchestrator(reference_spec("disk"), platform=cpu) as orch:
            orch.load()
            encoder = orch.module("text_encoder")
            assert all(t.numel() == 0 for t in encoder.state_dict().values())
            (path,) = (tmp_path / "offload").glob("tiny-t2i-*/text_encoder.safetensors")
            stored = load_file(str(path))
            orch.onload("text_encoder")
            weights = encoder.state_dict()
            assert set(stored) <= set(weights)
            assert all(torch.equal(stored[name], weights[name]) for name in stored)

    def test_failed_first_offload_leaves_nothing_armed(
        self, reference_spec: ReferenceSpec, cpu: Platform, tmp_path: Path
    ) -> None:
        """When load()'s first offload fails, the component stays LOADED and disarmed."""
        blocker = tmp_path / "not-a-folder"
        raw = msgspec.to_builtins(reference_spec("disk"))
        raw["memory"]["offload_dir"] = str(blocker)
        with Orchestrator(msgspec.convert(raw, PipelineSpec), platform=cpu) as orch:
            orch.admit()  # the folder could be made then; a file took its place since
            blocker.write_text("a file where the offload folder should go")
            with pytest.raises(TransitionFailed) as err:
                orch.load()
            assert err.value.component == "text_encoder"
            assert orch.state("text_encoder") is ComponentState.LOADED
            layers = [m for m in orch.module("text_encoder").modules() if isinstance(m, Attention)]
            assert layers
            assert not any(layer.is_armed for layer in layers)

    def test_host_offload_keeps_accounting_exact(
        self, reference_orchestrator: Orchestrator
    ) -> None:
        """With the host target the resident bytes follow the states exactly."""
        with reference_orchestrator as orch:
            orch.load()
            transformer = orch.component("transformer")
            assert transformer.state is ComponentState.RESIDENT
            before = orch.resident_bytes()
            orch.onload("vae")
            vae_bytes = orch.resident_bytes() - before
            assert vae_bytes == sum(t.nbytes for t in orch.module("vae").state_dict().values())
            orch.offload("vae")
            assert orch.resident_bytes() == before


class TestOffloadFolders:
    def test_two_workers_never_share_files(
        self, reference_spec: ReferenceSpec, cpu: Platform, tmp_path: Path
    ) -> None:
        """Two orchestrators of one spec offload apart; closing one spares the other."""
        spec = reference_spec("disk")
        first, second = Orchestrator(spec, platform=cpu), Orchestrator(spec, platform=cpu)
        first.load()
        second.load()
        assert len(list((tmp_path / "offload").glob("tiny-t2i-*/text_encoder.safetensors"))) == 2
        first.close()
        assert generate(second).shape == (1, 3, 16, 16)
        second.close()
        assert list((tmp_path / "offload").iterdir()) == []


class TestStages:
    def test_components_move_around_their_stage(self, reference_orchestrator: Orchestrator) -> None:
        """A stage onloads its offloaded components and offloads them after their last use."""
        with reference_orchestrator as orch:
            orch.load()
            with orch.request("r1") as request, request.stage("encode") as modules:
                assert orch.state("text_encoder") is ComponentState.RESIDENT
                assert modules["text_encoder"] is orch.module("text_encoder")
            assert orch.state("text_encoder") is ComponentState.OFFLOADED
            assert orch.state("transformer") is ComponentState.RESIDENT

    def test_in_use_component_cannot_be_moved_or_released(
        self, reference_orchestrator: Orchestrator
    ) -> None:
        """Offload and release of a component a request is using are refused."""
        with reference_orchestrator as orch:
            orch.load()
            with orch.request("r1") as request, request.stage("decode"):
                for action in (orch.offload, orch.release):
                    with pytest.raises(TransitionRefused) as err:
                        action("vae")
                    assert err.value.codes == ("residency.in_use",)
                    assert "in use by request(s) r1" in err.value.refusals[0].message
                assert orch.state("vae") is ComponentState.RESIDENT

    def test_resident_component_is_never_offloaded_by_hand(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """Offloading an explicitly resident component is refused with the fix."""
        spec = reference_spec(transformer={"residency": "resident"})
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()
            with pytest.raises(TransitionRefused) as err:
                orch.offload("transformer")
            assert err.value.codes == ("residency.not_offloadable",)

    def test_exception_in_a_stage_puts_everything_back(
        self, reference_orchestrator: Orchestrator
    ) -> None:
        """An error inside a stage propagates, the plan is restored, and the next request runs."""
        with reference_orchestrator as orch:
            orch.load()
            seen: list[ComponentState] = []

            def fail_in_a_stage() -> None:
                with orch.request() as request, request.stage("encode"):
                    seen.append(orch.state("text_encoder"))
                    raise RuntimeError("client went away")

            with pytest.raises(RuntimeError, match="client went away"):
                fail_in_a_stage()
            assert seen == [ComponentState.RESIDENT]
            assert orch.state("text_encoder") is ComponentState.OFFLOADED
            assert orch.snapshot().components["vae"].state is ComponentState.OFFLOADED
            assert generate(orch).shape == (1, 3, 16, 16)

    def test_adjacent_stages_share_one_interval(self, cpu: Platform) -> None:
        """A component used by two stages in a row moves in once and out once."""
        spec = decode_spec(
            """
name = "p"
[components.vae]
kind = "tiny_vae"
residency = "component_offload"
[[stages]]
name = "first"
uses = ["vae"]
[[stages]]
name = "second"
uses = ["vae"]
"""
        )
        observed = EventRecorder()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            observed.clear()
            with orch.request("r1") as request:
                for stage in ("first", "second"):
                    with request.stage(stage):
                        pass
        assert [(m.direction, m.request_id) for m in observed.of(Move)] == [
            ("onload", "r1"),
            ("offload", "r1"),
        ]

    def test_request_events(self, reference_orchestrator: Orchestrator) -> None:
        """A request logs begin and end with its stages; its moves carry its id."""
        with reference_orchestrator as orch:
            orch.load()
            with capture_events() as events:
                generate(orch)
        (begin,) = events_named(events, "request.begin")
        (end,) = events_named(events, "request.end")
        assert end["stages"] == list(STAGES)
        assert end["request_id"] == begin["request_id"]
        assert end["duration_ms"] > 0
        moved = events_named(events, "residency.moved")
        assert {e["request_id"] for e in moved} == {begin["request_id"]}
        assert {(e["component"], e["direction"]) for e in moved} == {
            ("text_encoder", "onload"),
            ("text_encoder", "offload"),
            ("vae", "onload"),
            ("vae", "offload"),
        }

    def test_duplicate_open_request_id(self, reference_orchestrator: Orchestrator) -> None:
        """Two open requests may not share an id."""
        with reference_orchestrator as orch:
            orch.load()
            with (
                orch.request("r1"),
                pytest.raises(ValueError, match="'r1' is already open"),
                orch.request("r1"),
            ):
                pass


NEXT_USES = {"s0": ["a"], "s1": ["b"], "s2": ["c"], "s3": ["a"], "s4": ["b"]}
"""Three offloaded VAEs whose next uses differ: a is used again before b."""


class TestMemoryBudget:
    def test_evicts_the_furthest_next_use_not_the_least_recent(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """Onloading c evicts b (next used at s4), not a (used at s3), though a is older."""
        spec = vae_pipeline(2 * VAE_BYTES + 1000, NEXT_USES)
        observed = EventRecorder()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            observed.clear()
            with orch.request("r1") as request:
                for stage in ("s0", "s1", "s2", "s3", "s4"):
                    with request.stage(stage):
                        assert orch.resident_bytes() <= 2 * VAE_BYTES + 1000
        sequence = [(m.component, m.direction) for m in observed.of(Move)]
        assert sequence[:4] == [
            ("a", "onload"),
            ("b", "onload"),
            ("b", "offload"),  # evicted for c: its next use (s4) is furthest
            ("c", "onload"),
        ]
        assert sequence.count(("a", "onload")) == 1  # a stayed resident for s3

    def test_refusal_carries_the_numbers(self, cpu: Platform, vae_pipeline: VaePipeline) -> None:
        """With no time to wait, an onload blocked by a busy component is refused with numbers."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=0)
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()
            with (
                orch.request("r1") as first,
                first.stage("s0"),
                orch.request("r2") as second,
                pytest.raises(TransitionRefused) as err,
                second.stage("s1"),
            ):
                pass
            assert err.value.codes == ("residency.memory_budget",)
            message = err.value.refusals[0].message
            assert "onloading 'b' needs 242.8 KiB on device, 1000 B free of a 243.7 KiB" in message
            assert "(a cannot be evicted now)" in message
            assert orch.state("b") is ComponentState.OFFLOADED
            assert orch.state("a") is ComponentState.OFFLOADED

    def test_the_stage_position_reaches_the_budget_guard(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """A stage's onload hands the guard its MoveArgs: it picks the victim from that position.

        From before the first stage a is needed next (s0), so a manual onload of c evicts
        b; from s2, b is needed next (s3), so the stage's onload of c evicts a instead,
        and the eviction is the request's.
        """
        stages = {"s0": ["a"], "s1": ["b"], "s2": ["c"], "s3": ["b"], "s4": ["a"]}
        observed = EventRecorder()
        spec = vae_pipeline(2 * VAE_BYTES + 1000, stages)
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            orch.onload("a")
            orch.onload("b")
            orch.onload("c")
            assert orch.state("b") is ComponentState.OFFLOADED
            orch.offload("c")
            orch.onload("b")
            observed.clear()
            with orch.request("r1") as request, request.stage("s2"):
                assert orch.state("a") is ComponentState.OFFLOADED
                assert orch.state("b") is ComponentState.RESIDENT
        moves = observed.of(Move)
        assert [(m.component, m.direction, m.request_id) for m in moves][:2] == [
            ("a", "offload", "r1"),
            ("c", "onload", "r1"),
        ]

    @pytest.mark.parametrize("x_is_used", [True, False], ids=["x used later", "x used by none"])
    def test_evicts_only_what_its_own_offload_allows(
        self, cpu: Platform, vae_pipeline: VaePipeline, x_is_used: bool
    ) -> None:
        """The budget evicts x exactly when x's offload guards pass: else it refuses up front.

        x is resident by default, so the budget may evict it, unless no stage uses it
        (its offload is refused: nothing would bring it back). Had the budget's choice
        and x's guards disagreed, the onload would fail half-way instead.
        """
        stages = {"s0": ["a"], "s1": ["x"]} if x_is_used else {"s0": ["a"]}
        spec = vae_pipeline(VAE_BYTES + 1000, stages, residency={"x": None}, wait_timeout=0)
        observed = EventRecorder()
        with Orchestrator(spec, platform=cpu, observer=observed) as orch:
            orch.load()
            assert orch.state("x") is ComponentState.RESIDENT
            observed.clear()
            if x_is_used:
                with orch.request("r1") as request, request.stage("s0"):
                    assert orch.state("a") is ComponentState.RESIDENT
                moves = observed.of(Move)
                assert [(m.component, m.direction) for m in moves][:2] == [
                    ("x", "offload"),
                    ("a", "onload"),
                ]
            else:
                with (
                    pytest.raises(TransitionRefused) as err,
                    orch.request("r1") as request,
                    request.stage("s0"),
                ):
                    pass
                assert err.value.codes == ("residency.memory_budget",)
                assert "(x cannot be evicted now)" in err.value.refusals[0].message
                assert observed.of(Move) == []
                assert orch.state("x") is ComponentState.RESIDENT
                assert orch.state("a") is ComponentState.OFFLOADED

    def test_admission_refuses_a_stage_that_cannot_fit(
        self, cpu: Platform, vae_pipeline: VaePipeline
    ) -> None:
        """A budget smaller than one stage's components is refused before anything loads."""
        spec = vae_pipeline(1000, NEXT_USES)
        with Orchestrator(spec, platform=cpu) as orch:
            with pytest.raises(TransitionRefused) as err:
                orch.admit()
            assert set(err.value.codes) == {"residency.memory_budget"}
            assert "stage 's0' needs 242.8 KiB on device at once" in str(err.value)


class TestThreads:
    @pytest.mark.parametrize("layerwise", [False, True], ids=["component", "layerwise-disk"])
    def test_concurrent_requests_keep_counts_right(
        self, reference_spec: ReferenceSpec, cpu: Platform, layerwise: bool
    ) -> None:
        """Requests from four threads run every stage; counts end at zero, states as planned."""
        errors: list[BaseException] = []
        streamed = {"residency": "layerwise_offload"}
        spec = (
            reference_spec("disk", text_encoder=streamed, transformer=streamed)
            if layerwise
            else reference_spec()
        )
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()
            reference = generate(orch, 0)

            def serve(worker: int) -> None:
                try:
                    for _ in range(3):
                        assert torch.equal(generate(orch, 0), reference)
                except BaseException as err:  # collected and re-raised in the main thread
                    errors.append(err)

            threads = [threading.Thread(target=serve, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert errors == []
            assert all(orch.component(name).in_use_by == () for name in orch.spec.components)
            assert orch.state("text_encoder") is ComponentState.OFFLOADED
            assert orch.state("vae") is ComponentState.OFFLOADED

    def test_in_use_is_visible_while_a_stage_runs(
        self, reference_orchestrator: Orchestrator
    ) -> None:
        """While a request holds a stage, the view names it; afterwards nobody."""
        with reference_orchestrator as orch:
            orch.load()
            with orch.request("r9") as request, request.stage("decode"):
                assert orch.component("vae").in_use_by == ("r9",)
            assert orch.component("vae").in_use_by == ()


class TestPrefetch:
    def test_no_prefetch_on_cpu(self, reference_orchestrator: Orchestrator) -> None:
        """On a CPU the host is the device: nothing is prefetched or reserved."""
        with reference_orchestrator as orch:
            orch.load()
            with orch.request() as request, request.stage("denoise"):
                assert orch.component("vae").prefetching is False

    @pytest.mark.cuda
    def test_next_stage_is_prefetched_and_completed_by_onload(
        self, reference_spec: ReferenceSpec
    ) -> None:
        """On CUDA the next stage's offloaded component is prefetched, then onloaded, equal."""
        spec = msgspec.structs.replace(reference_spec(), device="cuda")
        with Orchestrator(spec) as orch:
            orch.load()
            batch = Batch(generator=torch.Generator().manual_seed(0), steps=2)
            with orch.request() as request:
                request.run("encode", batch)
                with request.stage("denoise"):
                    assert orch.component("vae").prefetching is True
                    assert orch.state("vae") is ComponentState.OFFLOADED
                request.run("decode", batch)
                assert orch.component("vae").prefetching is False
            assert batch.images is not None

    @pytest.mark.cuda
    def test_unused_prefetch_is_given_up_at_request_end(
        self, reference_spec: ReferenceSpec
    ) -> None:
        """A prefetch the request never onloaded is cancelled when the request ends."""
        spec = msgspec.structs.replace(reference_spec(), device="cuda")
        with Orchestrator(spec) as orch:
            orch.load()
            with orch.request() as request, request.stage("denoise"):
                assert orch.component("vae").prefetching is True
            assert orch.component("vae").prefetching is False
            assert orch.state("vae") is ComponentState.OFFLOADED
