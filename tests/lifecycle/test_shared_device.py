"""Several pipelines on one SharedDevice: one budget, eviction across pipelines, shared parts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attention import Platform
from components.batch import Batch
from lifecycle.admission.budget import EvictionRank, eviction_order
from lifecycle.device.shared import SharedDevice, worker_budget
from lifecycle.device.timeline import Timeline
from lifecycle.events import Move, RequestBegan, Transitioned
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused, RefusalCode
from lifecycle.spec.reading import decode_spec, load_worker_file
from lifecycle.spec.structs import WorkerFile
from lifecycle.testing import EventRecorder, capture_events, events_named
from tests.lifecycle.conftest import DIT_BYTES, ENCODER_BYTES, VAE_BYTES, T2iPipeline

ONE_DIT = DIT_BYTES + VAE_BYTES + 30_000
"""A budget that holds one DiT beside the VAE, never two DiTs beside it."""


def generate(orchestrator: Orchestrator, seed: int = 0) -> torch.Tensor:
    """Run one seeded two-step request through every stage; return its images."""
    batch = Batch(generator=torch.Generator().manual_seed(seed), steps=2, prompts=["a red fox"])
    with orchestrator.request() as request:
        request.run_all(batch)
    assert batch.images is not None
    return batch.images


@pytest.fixture
def twins(
    t2i_pipeline: T2iPipeline, cpu: Platform
) -> Iterator[tuple[Orchestrator, Orchestrator, EventRecorder, EventRecorder]]:
    """Two loaded pipelines ('a', 'b') under a budget of one DiT; they share the encoder."""
    device = SharedDevice(device_budget=ONE_DIT, budget_key="--device-budget")
    seen_a, seen_b = EventRecorder(), EventRecorder()
    a = Orchestrator(t2i_pipeline("a", 2), platform=cpu, shared=device, observer=seen_a)
    b = Orchestrator(
        t2i_pipeline("b", 5, vae={"options": {"seed": 4}}),
        platform=cpu,
        shared=device,
        observer=seen_b,
    )
    a.load()
    b.load()
    yield a, b, seen_a, seen_b
    a.close()
    b.close()


class TestSharedBudget:
    def test_alternating_requests_evict_and_reload_the_dits(
        self,
        twins: tuple[Orchestrator, Orchestrator, EventRecorder, EventRecorder],
        t2i_pipeline: T2iPipeline,
        cpu: Platform,
    ) -> None:
        """Each request evicts the other pipeline's DiT, the shared encoder is loaded once,
        and every output equals its pipeline run alone."""
        a, b, seen_a, seen_b = twins
        images: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
        for orchestrator in (a, b, a, b):
            images[orchestrator.spec.name].append(generate(orchestrator))
        (r1, r3), (r2, r4) = (
            [e.request_id for e in seen.of(RequestBegan)] for seen in (seen_a, seen_b)
        )
        dits = {
            name: [
                (m.direction, m.request_id) for m in seen.of(Move) if m.component == "transformer"
            ]
            for name, seen in (("a", seen_a), ("b", seen_b))
        }
        # both DiTs onloaded at load; then each request's decode evicts the DiT of the
        # other pipeline (asked less recently), and the next request of that one reloads it
        assert dits["a"] == [("onload", None), ("offload", r2), ("onload", r3), ("offload", r4)]
        assert dits["b"] == [
            ("onload", None),
            ("offload", r1),
            ("onload", r2),
            ("offload", r3),
            ("onload", r4),
        ]
        loads = [
            e.component
            for recorder in (seen_a, seen_b)
            for e in recorder.of(Transitioned)
            if e.trigger == "load"
        ]
        assert loads.count("text_encoder") == 1
        assert a.module("text_encoder") is b.module("text_encoder")
        assert a.shared.saved_bytes() == ENCODER_BYTES
        for name, transformer_seed, vae in (("a", 2, {}), ("b", 5, {"options": {"seed": 4}})):
            with Orchestrator(t2i_pipeline(name, transformer_seed, vae=vae), platform=cpu) as alone:
                alone.load()
                expected = generate(alone)
            assert all(torch.equal(image, expected) for image in images[name])

    def test_budget_holds_every_pipeline_together(
        self, twins: tuple[Orchestrator, Orchestrator, EventRecorder, EventRecorder]
    ) -> None:
        """After every move of either pipeline, what is resident fits the one budget."""
        a, b, _, _ = twins
        totals: list[int] = []

        def total(event: object) -> None:
            if isinstance(event, Move):
                totals.append(a.shared.resident_bytes())

        a.observe(total)
        b.observe(total)
        for orchestrator in (a, b, b, a):
            generate(orchestrator)
        assert totals
        assert max(totals) <= ONE_DIT

    def test_single_pipeline_keeps_its_dit(self, t2i_pipeline: T2iPipeline, cpu: Platform) -> None:
        """Alone under the same budget, a pipeline's DiT stays resident between requests."""
        device = SharedDevice(device_budget=ONE_DIT)
        seen = EventRecorder()
        with Orchestrator(t2i_pipeline("a"), platform=cpu, shared=device, observer=seen) as a:
            a.load()
            generate(a)
            generate(a)
            assert a.state("transformer") is ComponentState.RESIDENT
        assert [m.direction for m in seen.of(Move) if m.component == "transformer"] == ["onload"]


class TestDeviceState:
    """The device owns what it knows of its pipelines and requests: its methods write it."""

    def test_a_request_id_is_open_once_on_the_device(self) -> None:
        """Opening an open request id again is refused; once closed, the id may open again."""
        device = SharedDevice()
        key = device.register("a", Timeline(()), "cpu")
        device.open_request("r1", key)
        with pytest.raises(ValueError, match="request 'r1' is already open"):
            device.open_request("r1", key)
        assert (device.open_requests_of(key), device.pipeline_of("r1")) == (["r1"], "a")
        device.close_request("r1")
        assert (device.open_requests_of(key), device.pipeline_of("r1")) == ([], None)
        device.open_request("r1", key)

    def test_a_closed_request_ends_the_wait_for_its_pipeline(self) -> None:
        """A wait for a pipeline's requests returns once its last open request closes
        (whether the wait began before the close or after it)."""
        device = SharedDevice()
        key = device.register("a", Timeline(()), "cpu")
        device.open_request("r1", key)
        waiting = threading.Thread(target=device.wait_for_requests, args=(key, 600.0))
        waiting.start()
        device.close_request("r1")
        waiting.join(timeout=600.0)
        assert not waiting.is_alive()

    def test_asleep_only_while_every_user_sleeps(self) -> None:
        """A component's users are all asleep only when each of them sleeps."""
        device = SharedDevice()
        a, b = (device.register(name, Timeline(()), "cpu") for name in ("a", "b"))
        assert not device.all_asleep([a, b])
        device.sleep(a)
        assert (device.is_asleep(a), device.all_asleep([a]), device.all_asleep([a, b])) == (
            True,
            True,
            False,
        )
        device.wake(a)
        assert not device.is_asleep(a)

    def test_the_second_pipeline_of_a_name_has_its_own_key(self) -> None:
        """Two pipelines of one name on the device get two keys, each named after it."""
        device = SharedDevice()
        keys = [device.register("a", Timeline(()), "cpu") for _ in range(2)]
        assert keys == ["a", "a#2"]
        assert [device.name_of(key) for key in keys] == ["a", "a"]
        device.unregister("a#2")
        assert device.name_of("a#2") == "a#2"


class TestEvictionOrder:
    def test_least_recently_asked_pipeline_goes_first(self) -> None:
        """A component of the pipeline asked longest ago goes before any of a later one."""
        ranks = {
            "b/transformer": EvictionRank(last_asked=1, distance=1.0),
            "vae": EvictionRank(last_asked=2, distance=float("inf")),
            "transformer": EvictionRank(last_asked=2, distance=1.0),
        }
        assert eviction_order(ranks) == ["b/transformer", "vae", "transformer"]

    def test_furthest_next_use_within_a_pipeline(self) -> None:
        """Within one pipeline the component used furthest ahead goes first, then by name."""
        ranks = {
            "c": EvictionRank(last_asked=3, distance=1.0),
            "b": EvictionRank(last_asked=3, distance=2.0),
            "a": EvictionRank(last_asked=3, distance=2.0),
        }
        assert eviction_order(ranks) == ["a", "b", "c"]


class TestWorkerBudget:
    def test_command_line_then_file_then_smallest_spec_budget(
        self, t2i_pipeline: T2iPipeline, tmp_path: Path
    ) -> None:
        """--device-budget wins, then [worker] device_budget, then the smallest spec budget."""
        specs = [
            t2i_pipeline("a", memory={"device_budget": 900_000}),
            t2i_pipeline("b", memory={"device_budget": 700_000}),
            t2i_pipeline("c"),
        ]
        path = tmp_path / "worker.toml"
        path.write_text('[worker]\ndevice_budget = "1MiB"\n')
        file = load_worker_file(path)
        assert worker_budget(specs, 5, file) == (5, "--device-budget")
        assert worker_budget(specs, None, file) == (2**20, "worker.device_budget")
        assert worker_budget(specs, None, None) == (700_000, "memory.device_budget")
        assert worker_budget(specs[2:], None, WorkerFile()) == (None, "memory.device_budget")

    def test_a_spec_budget_the_device_replaces_is_said(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """A spec's own budget under a worker budget is replaced, with a warning naming both."""
        device = SharedDevice(device_budget=ONE_DIT, budget_key="--device-budget")
        with capture_events() as events:
            Orchestrator(
                t2i_pipeline("a", memory={"device_budget": 10**9}), platform=cpu, shared=device
            ).close()
        (warning,) = events_named(events, "lifecycle.budget_replaced")
        assert (warning["spec_budget"], warning["device_budget"]) == (10**9, ONE_DIT)

    def test_admission_counts_the_others_pinned_components(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """A stage that fits alone but not beside another pipeline's pinned DiT is refused,
        naming the pipeline and the worker budget's key."""
        device = SharedDevice(device_budget=ONE_DIT, budget_key="--device-budget")
        pinned = {"residency": "resident"}
        with Orchestrator(t2i_pipeline("a", transformer=pinned), platform=cpu, shared=device) as a:
            a.admit()
            b = Orchestrator(t2i_pipeline("b", 5, transformer=pinned), platform=cpu, shared=device)
            with pytest.raises(AdmissionRefused) as err:
                b.admit()
            b.close()
        encode, decode = err.value.refusals
        assert {encode.code, decode.code} == {RefusalCode.MEMORY_BUDGET}
        assert "stage 'decode' of pipeline 'b'" in decode.message
        assert "a/transformer 166.4 KiB" in decode.message
        assert decode.hint.startswith("raise --device-budget to at least 575.5 KiB")

    def test_pipelines_on_two_kinds_of_device_are_refused(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """One budget cannot cover a CPU pipeline and a CUDA one: the second is a ValueError."""
        device = SharedDevice()
        Orchestrator(t2i_pipeline("a"), platform=cpu, shared=device)
        with pytest.raises(ValueError, match="runs on cuda, the others on this device on cpu"):
            Orchestrator(t2i_pipeline("b"), platform=Platform("cuda"), shared=device)


class TestSharedComponents:
    def test_released_with_its_last_user(
        self, twins: tuple[Orchestrator, Orchestrator, EventRecorder, EventRecorder]
    ) -> None:
        """Closing one user leaves the shared encoder loaded for the other; closing the last
        releases it and takes it off the device."""
        a, b, _, _ = twins
        a.close()
        assert b.state("text_encoder") is ComponentState.OFFLOADED
        assert b.component("text_encoder").users == ("b",)
        generate(b)
        b.close()
        assert b.state("text_encoder") is ComponentState.RELEASED
        assert a.shared.slots == {}

    def test_snapshot_shows_the_users(
        self, twins: tuple[Orchestrator, Orchestrator, EventRecorder, EventRecorder]
    ) -> None:
        """Each pipeline's snapshot names both users of the shared encoder, one of the rest."""
        a, b, _, _ = twins
        for pipeline in (a, b):
            users = {name: c.users for name, c in pipeline.snapshot().components.items()}
            own = (pipeline.key,)
            assert users == {"text_encoder": ("a", "b"), "transformer": own, "vae": own}

    def test_one_observer_of_both_hears_a_shared_move_once(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """An observer of both pipelines (a worker's metrics) hears each move of the shared
        encoder once; one attached later to either hears them too."""
        device = SharedDevice()
        both = EventRecorder()
        a = Orchestrator(t2i_pipeline("a"), platform=cpu, shared=device, observer=both)
        b = Orchestrator(t2i_pipeline("b", 5), platform=cpu, shared=device, observer=both)
        a.load()
        b.load()
        generate(b)
        late = EventRecorder()
        a.observe(late)
        generate(b)
        encoder = [
            (m.direction, m.request_id) for m in both.of(Move) if m.component == "text_encoder"
        ]
        heard_late = [m.direction for m in late.of(Move) if m.component == "text_encoder"]
        a.close()
        b.close()
        assert encoder == [
            ("offload", None),  # placed by a's load; b shares it, and loads nothing
            ("onload", "r1"),
            ("offload", "r1"),
            ("onload", "r2"),
            ("offload", "r2"),
        ]
        assert heard_late == ["onload", "offload"]

    def test_a_shared_disk_component_outlives_its_home(
        self, t2i_pipeline: T2iPipeline, cpu: Platform, tmp_path: Path
    ) -> None:
        """On the disk target, the pipeline that built a shared component may close first:
        its file stays for the other user, and the folder goes with the last one."""
        device = SharedDevice()
        disk = {"offload_target": "disk"}
        a = Orchestrator(t2i_pipeline("a", memory=disk), platform=cpu, shared=device)
        b = Orchestrator(t2i_pipeline("b", 5, memory=disk), platform=cpu, shared=device)
        a.load()
        b.load()
        (folder,) = (tmp_path / "offload").iterdir()  # a's: b made no file of its own
        a.close()
        assert {p.name for p in folder.iterdir()} >= {"text_encoder.safetensors", "vae.safetensors"}
        generate(b)
        b.close()
        assert not folder.exists()

    def test_unequal_components_are_not_shared(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """Another seed, or another residency, makes another component."""
        device = SharedDevice()
        a = Orchestrator(t2i_pipeline("a"), platform=cpu, shared=device)
        b = Orchestrator(
            t2i_pipeline("b", 5, text_encoder={"residency": "resident"}),
            platform=cpu,
            shared=device,
        )
        a.load()
        b.load()
        assert {n: c.users for n, c in b.snapshot().components.items()} == {
            "text_encoder": ("b",),
            "transformer": ("b",),
            "vae": ("a", "b"),
        }
        assert device.saved_bytes() == VAE_BYTES
        a.close()
        b.close()

    def test_a_private_device_reads_no_checksums(
        self, t2i_pipeline: T2iPipeline, cpu: Platform
    ) -> None:
        """A pipeline alone on its device compares nothing: no identity is taken."""
        with Orchestrator(t2i_pipeline("a"), platform=cpu) as alone:
            alone.load()
            assert all(slot.identity is None for slot in alone.shared.slots.values())


def spec_with_weights(path: Path, name: str) -> str:
    """Return a one-stage spec of a tiny upsampler reading ``path``."""
    return f"""
name = "{name}"
device = "cpu"
[components.up]
kind = "tiny_upsampler"
options = {{ weights = "{path}" }}
[[stages]]
name = "s"
uses = ["up"]
"""


class TestWeightsIdentity:
    def test_equal_content_under_two_paths_is_shared(self, tmp_path: Path, cpu: Platform) -> None:
        """Two files with the same tensors are one component; other data is another."""
        from safetensors.torch import save_file

        from components import registry

        module = registry.get("tiny_upsampler").from_options({}).build("custom")
        tensors = {n: t.clone() for n, t in module.state_dict().items()}
        save_file(tensors, str(tmp_path / "one.safetensors"))
        save_file(tensors, str(tmp_path / "two.safetensors"))
        tensors["conv_mid.bias"][0] += 1
        save_file(tensors, str(tmp_path / "other.safetensors"))
        device = SharedDevice()
        pipelines = [
            Orchestrator(
                decode_spec(spec_with_weights(tmp_path / f, n)), platform=cpu, shared=device
            )
            for f, n in (
                ("one.safetensors", "p"),
                ("two.safetensors", "q"),
                ("other.safetensors", "r"),
            )
        ]
        for pipeline in pipelines:
            pipeline.load()
        users = [pipeline.component("up").users for pipeline in pipelines]
        assert users == [("p", "q"), ("p", "q"), ("r",)]
        for pipeline in pipelines:
            pipeline.close()
