"""Adapters (LoRA) as a lifecycle: admission by shape, exact merge and unmerge, per request."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from torch import nn

from attention import Platform
from benchmarks.make_adapter import write_lora
from components import registry as kinds
from components.batch import Batch
from lifecycle.device.shared import SharedDevice
from lifecycle.events import AdapterSwitched, AdapterTransitioned
from lifecycle.machines.tables import AdapterState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused, TransitionRefused
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import AdapterSpec
from lifecycle.testing import EventRecorder
from tests.conftest import Lifecycle

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_t2i.toml"


def linear_shapes(
    kind: str, path: str = "custom", contains: str = ""
) -> dict[str, tuple[int, int]]:
    """Return ``out x in`` of the linear layers of ``kind`` built on ``path`` (on meta)."""
    loader = kinds.get(kind).from_options({})
    with torch.device("meta"):
        module = loader.construct(path)  # type: ignore[arg-type]
    return {
        name: (layer.out_features, layer.in_features)
        for name, layer in module.named_modules()
        if isinstance(layer, nn.Linear) and contains in name
    }


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 LoRA of the tiny DiT's MLPs, in diffusers' pipeline layout."""
    out = tmp_path_factory.mktemp("adapters") / "mlp.safetensors"
    return write_lora(linear_shapes("tiny_dit", contains="mlp"), out, prefix="transformer")


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 LoRA of the tiny DiT's output projections, alpha 4, with another seed."""
    out = tmp_path_factory.mktemp("adapters") / "out.safetensors"
    shapes = linear_shapes("tiny_dit", contains="out_proj")
    return write_lora(shapes, out, prefix="transformer", rank=8, alpha=4.0, seed=3)


def spec_with(adapters: str, *, extra: str = "") -> Any:
    """Return the reference spec on the CPU with the ``[adapters]`` tables ``adapters``."""
    text = EXAMPLE.read_text().replace('device = "auto"', 'device = "cpu"')
    return decode_spec(extra + text + adapters)


def generate(orch: Orchestrator, adapters: list[dict[str, float]] | None, size: int = 2) -> Any:
    """Run one request of ``size`` rows naming ``adapters``; return its images."""
    batch = Batch(generator=torch.Generator().manual_seed(0), steps=2, size=size, adapters=adapters)
    with orch.request() as request:
        request.run_all(batch)
    return batch.images


@pytest.fixture
def orch(lora: Path, other: Path, cpu: Platform) -> Any:
    """The reference pipeline, loaded, with a merged and an unmerged copy of each LoRA."""
    spec = spec_with(
        f'[adapters.mlp]\npath = "{lora}"\n'
        f'[adapters.mlp_u]\npath = "{lora}"\nmode = "unmerged"\n'
        f'[adapters.out]\npath = "{other}"\nscale = 0.5\n'
        f'[adapters.out_u]\npath = "{other}"\nmode = "unmerged"\n'
    )
    with Orchestrator(spec, platform=cpu) as orchestrator:
        orchestrator.load()
        yield orchestrator


def weights(orch: Orchestrator) -> dict[str, torch.Tensor]:
    """Return the transformer's weights now (the tensors themselves, not copies)."""
    return {k: v.data for k, v in orch.module("transformer").state_dict(keep_vars=True).items()}


class TestAdmission:
    """Each refusal is found from the header alone, through ``check --json``."""

    @pytest.mark.parametrize(
        ("case", "code"),
        [
            ("shape", "adapter.target_mismatch"),
            ("missing", "adapter.target_mismatch"),
            ("offloaded", "adapter.offloaded_component"),
            ("evictable", "adapter.offloaded_component"),
            ("sharded", "adapter.sharded_component"),
            ("native", "adapter.native_unsupported"),
        ],
    )
    def test_refused_through_check_json(
        self, case: str, code: str, lifecycle: Lifecycle, tmp_path: Path, lora: Path
    ) -> None:
        """A mismatched shape or layer, an offloaded, sharded or native component: exit 1, code."""
        text = EXAMPLE.read_text().replace('device = "auto"', 'device = "cpu"')
        table = f'[adapters.a]\npath = "{lora}"\n'
        if case == "shape":
            write_lora(
                {"blocks.0.mlp.0": (64, 16)}, tmp_path / "a.safetensors", prefix="transformer"
            )
            table = f'[adapters.a]\npath = "{tmp_path / "a.safetensors"}"\n'
        elif case == "missing":
            write_lora(
                {"blocks.9.mlp.0": (64, 32)}, tmp_path / "a.safetensors", prefix="transformer"
            )
            table = f'[adapters.a]\npath = "{tmp_path / "a.safetensors"}"\n'
        elif case == "offloaded":
            text = text.replace(
                'kind = "tiny_dit"', 'kind = "tiny_dit"\nresidency = "component_offload"'
            )
        elif case == "evictable":  # resident by default, but a budget may evict it
            text = text.replace("[memory]", '[memory]\ndevice_budget = "1GB"')
        elif case == "sharded":
            text = text.replace("[memory]", "[parallel]\ntp_size = 2\n\n[memory]")
        else:
            shapes = linear_shapes("tiny_text_encoder", contains="linear1")
            shapes["layers.0.self_attn.in_proj"] = (96, 32)
            write_lora(shapes, tmp_path / "a.safetensors", prefix="text_encoder")
            text = text.replace(
                'kind = "tiny_text_encoder"', 'kind = "tiny_text_encoder"\nloader = "native"'
            )
            table = f'[adapters.a]\npath = "{tmp_path / "a.safetensors"}"\nmode = "unmerged"\n'
        spec = tmp_path / "spec.toml"
        spec.write_text(text + table)
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 1, result.stdout + result.stderr
        refusals = json.loads(result.stdout)["refusals"]
        found = [r for r in refusals if r["component"] == "a"]
        assert [r["code"] for r in found] == [code]
        assert found[0]["hint"]
        if case == "shape":
            assert (
                "'transformer.blocks.0.mlp.0.lora_A.weight' has shape [4, 16]"
                in found[0]["message"]
            )
            assert "takes [4, 32]" in found[0]["message"]

    def test_component_from_the_keys_prefix(self, lora: Path, cpu: Platform) -> None:
        """Without ``component`` the keys' common prefix names it; the adapter ends LOADED."""
        with Orchestrator(spec_with(f'[adapters.a]\npath = "{lora}"\n'), platform=cpu) as orch:
            orch.load()
            (view,) = orch.adapters()
        assert (view.component, view.state, view.mode) == (
            "transformer",
            AdapterState.LOADED,
            "merged",
        )

    def test_unknown_component_is_a_config_error(self, lora: Path) -> None:
        """An adapter naming an undeclared component is a ConfigError naming its key."""
        with pytest.raises(ConfigError) as caught:
            spec_with(f'[adapters.a]\npath = "{lora}"\ncomponent = "unet"\n')
        assert caught.value.path == "$.adapters.a.component"

    def test_refused_adapter_refuses_the_pipeline(self, tmp_path: Path, cpu: Platform) -> None:
        """A refused adapter refuses admission as a whole: every component stays CONFIGURED."""
        write_lora({"blocks.0.mlp.0": (64, 16)}, tmp_path / "a.safetensors", prefix="transformer")
        spec = spec_with(f'[adapters.a]\npath = "{tmp_path / "a.safetensors"}"\n')
        with Orchestrator(spec, platform=cpu) as orch:
            with pytest.raises(AdmissionRefused):
                orch.admit()
            assert orch.state("transformer").value == "configured"
            assert orch.adapters()[0].state is AdapterState.CONFIGURED


class TestMergeAndUnmerge:
    """A merge keeps the base: unmerging puts the very tensors back, bit for bit."""

    def test_unmerge_restores_the_base_bit_for_bit(self, orch: Orchestrator) -> None:
        """After merged requests, a base request's weights and image equal the base."""
        before = weights(orch)
        copies = {k: v.clone() for k, v in before.items()}
        base = generate(orch, None)
        generate(orch, [{"mlp": 0.8, "out": 1.3}] * 2)
        merged_now = weights(orch)
        assert not torch.equal(merged_now["blocks.0.mlp.0.weight"], copies["blocks.0.mlp.0.weight"])
        assert torch.equal(generate(orch, None), base)
        after = weights(orch)
        for key, tensor in after.items():
            assert tensor.data_ptr() == before[key].data_ptr(), key  # the base storage itself
            assert torch.equal(tensor, copies[key]), key

    def test_merged_equals_unmerged(self, orch: Orchestrator) -> None:
        """A merged adapter and the same file unmerged give the same image at the same scale."""
        merged = generate(orch, [{"mlp": 0.7, "out": 2.0}] * 2)
        unmerged = generate(orch, [{"mlp_u": 0.7, "out_u": 2.0}] * 2)
        base = generate(orch, None)
        assert (merged - unmerged).abs().max() <= 1e-5
        assert (merged - base).abs().max() > 1e-2  # the adapters change the image

    def test_switches_are_transitions_and_counted(self, orch: Orchestrator) -> None:
        """A switch deactivates and activates through the machine, and is counted once."""
        recorder = EventRecorder()
        stop = orch.observe(recorder)
        generate(orch, [{"mlp": 1.0}] * 2)
        generate(orch, [{"mlp": 1.0}] * 2)  # the same set: no switch
        generate(orch, [{"out": 0.5}] * 2)
        stop()
        assert [s.merged for s in recorder.of(AdapterSwitched)] == [{"mlp": 1.0}, {"out": 0.5}]
        assert orch.adapter_switches == 2
        moves = [(e.adapter, e.trigger) for e in recorder.of(AdapterTransitioned)]
        assert moves == [("mlp", "activate"), ("mlp", "deactivate"), ("out", "activate")]

    def test_no_merge_into_a_component_another_pipeline_shares(
        self, lora: Path, cpu: Platform
    ) -> None:
        """Two pipelines holding one DiT: a merge for one is refused; unmerged still serves."""
        tables = (
            f'[adapters.a]\npath = "{lora}"\n[adapters.u]\npath = "{lora}"\nmode = "unmerged"\n'
        )
        device = SharedDevice()
        first = Orchestrator(spec_with(tables), platform=cpu, shared=device)
        other = msgspec.structs.replace(spec_with(""), name="other")
        second = Orchestrator(other, platform=cpu, shared=device)
        first.load()
        second.load()
        base = generate(second, None)
        with pytest.raises(TransitionRefused) as caught:
            generate(first, [{"a": 1.0}] * 2)
        assert caught.value.codes == ("residency.in_use",)
        assert "share" in caught.value.refusals[0].message
        generate(first, [{"u": 1.0}] * 2)
        assert torch.equal(generate(second, None), base)
        first.close()
        second.close()

    def test_refused_switch_leaves_the_weights(self, lora: Path, cpu: Platform) -> None:
        """Removing a merged adapter while a request uses its component is refused; no move."""
        spec = spec_with(f'[adapters.a]\npath = "{lora}"\n')
        spec = msgspec.structs.replace(
            spec, memory=msgspec.structs.replace(spec.memory, wait_timeout=0.0)
        )
        refused: list[TransitionRefused] = []
        seen: list[bool] = []

        def remove_midway(step: object) -> None:
            """Try to remove the merged adapter while this request's denoising step runs."""
            before = {k: v.clone() for k, v in weights(orch).items()}
            try:
                orch.remove_adapter("a")
            except TransitionRefused as err:
                refused.append(err)
            seen.append(all(torch.equal(v, before[k]) for k, v in weights(orch).items()))

        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()
            batch = Batch(
                generator=torch.Generator().manual_seed(0),
                steps=1,
                adapters=[{"a": 1.0}],
                on_step=remove_midway,
            )
            with orch.request() as request:
                request.run_all(batch)
            assert orch.adapters()[0].state is AdapterState.ACTIVE
        assert [err.codes for err in refused] == [("residency.in_use",)]
        assert seen == [True]


class TestBudget:
    """Adapter matrices and the bases merges keep are counted in ``memory.device_budget``."""

    def test_kept_base_is_counted(self, lora: Path, cpu: Platform) -> None:
        """A merge whose kept base would pass the budget is refused; the weights stay the base."""
        shapes = linear_shapes("tiny_dit", contains="mlp")
        matrices = sum(4 * (out + in_) for out, in_ in shapes.values()) * 4  # rank 4, float32
        kept = sum(out * in_ for out, in_ in shapes.values()) * 4
        text = (
            'name = "dit"\ndevice = "cpu"\n[components.transformer]\nkind = "tiny_dit"\n'
            'residency = "resident"\n[[stages]]\nname = "denoise"\nuses = ["transformer"]\n'
            f'[adapters.a]\npath = "{lora}"\n'
        )
        with Orchestrator(decode_spec(text), platform=cpu) as orch:
            orch.load()
            footprint = orch.component("transformer").footprint
        budget = footprint + matrices + kept - 1
        spec = decode_spec(
            text.replace("[components", f"[memory]\ndevice_budget = {budget}\n[components", 1)
        )
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()  # the matrices fit beside the DiT
            base = weights(orch)
            copies = {k: v.clone() for k, v in base.items()}
            with pytest.raises(TransitionRefused) as caught:
                generate(orch, [{"a": 1.0}], size=1)
            assert caught.value.codes == ("residency.memory_budget",)
            assert all(torch.equal(v, copies[k]) for k, v in weights(orch).items())
            assert orch.adapters()[0].state is AdapterState.LOADED
            generate(orch, None, size=1)  # the base still runs


class TestPerRequest:
    """Each request runs exactly the adapters it names, whoever runs beside it."""

    def test_unknown_adapter_names_the_known_ones(self, orch: Orchestrator) -> None:
        """A row naming an unknown adapter is refused before anything runs, listing the known."""
        with pytest.raises(ValueError, match="unknown adapter 'nope'; known adapters: mlp, mlp_u"):
            generate(orch, [{"nope": 1.0}])

    def test_rows_with_different_merged_sets_are_refused(self, orch: Orchestrator) -> None:
        """One batch cannot hold two merged sets of one component: it would need two weights."""
        with pytest.raises(ValueError, match="different merged adapters"):
            generate(orch, [{"mlp": 1.0}, {}])

    def test_mixed_unmerged_rows_need_a_kind_that_finds_rows(self, orch: Orchestrator) -> None:
        """The packed tiny DiT cannot tell rows apart: different unmerged sets are refused."""
        with pytest.raises(ValueError, match="different unmerged adapters"):
            generate(orch, [{"mlp_u": 1.0}, {}])

    def test_concurrent_requests_never_mix_weights(self, orch: Orchestrator) -> None:
        """Threads with different adapter sets each get what their set gives alone."""
        sets: list[list[dict[str, float]] | None] = [
            None,
            [{"mlp": 1.0}],
            [{"out": 0.5}],
            [{"mlp": 1.0, "out": 0.5}],
            [{"mlp_u": 0.9}],
        ]
        alone = [generate(orch, rows, size=1) for rows in sets]
        got: dict[int, Any] = {}
        errors: list[BaseException] = []

        def client(index: int) -> None:
            try:
                for round_ in range(2):
                    rows = sets[(index + round_) % len(sets)]
                    got[(index + round_) % len(sets) + 10 * index] = generate(orch, rows, size=1)
            except BaseException as err:  # surfaced below
                errors.append(err)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(sets))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        for key, image in got.items():
            assert torch.equal(image, alone[key % 10]), key


class TestAtRunTime:
    """Adapters are added and removed while the pipeline is loaded."""

    def test_add_and_remove(self, orch: Orchestrator, other: Path) -> None:
        """An added adapter serves requests; removed, it is unknown and the base is back."""
        base = generate(orch, None)
        view = orch.add_adapter("late", AdapterSpec(path=str(other), mode="merged"))
        assert (view.state, view.component) == (AdapterState.LOADED, "transformer")
        assert torch.equal(generate(orch, [{"late": 0.5}] * 2), generate(orch, [{"out": 0.5}] * 2))
        orch.remove_adapter("late")
        assert "late" not in [v.name for v in orch.adapters()]
        assert torch.equal(generate(orch, None), base)

    def test_refused_add_leaves_nothing(self, orch: Orchestrator, tmp_path: Path) -> None:
        """An added adapter that does not fit is refused with its code and not listed."""
        write_lora({"blocks.0.mlp.0": (64, 16)}, tmp_path / "a.safetensors", prefix="transformer")
        names = [v.name for v in orch.adapters()]
        with pytest.raises(TransitionRefused) as caught:
            orch.add_adapter("bad", AdapterSpec(path=str(tmp_path / "a.safetensors")))
        assert caught.value.codes == ("adapter.target_mismatch",)
        assert [v.name for v in orch.adapters()] == names
