"""Folders admission refuses, or that are bad input, and the lifecycle rules on real components."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from attention import Platform
from benchmarks.make_pipeline import DIMS, Family, t5
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused
from lifecycle.spec.reading import decode_spec, load_spec
from tests.components.folder_runs import Request, batch_of, run_diffusers
from tests.conftest import Lifecycle, PipelineFolders
from tests.lifecycle.folder_specs import largest_stage

pytestmark = pytest.mark.usefixtures("one_thread")

TRANSFORMER_WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"


def copied(folder: Path, into: Path) -> Path:
    """Copy pipeline ``folder`` into ``into`` (to corrupt it) and return the copy."""
    return shutil.copytree(folder, into / folder.name)


def edit_index(folder: Path, **entries: object) -> None:
    """Replace entries of ``folder``'s ``model_index.json``."""
    path = folder / "model_index.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **entries}))


def edit_weights(path: Path, **tensors: torch.Tensor | None) -> None:
    """Rewrite the safetensors file at ``path`` with ``tensors`` replaced (None: removed)."""
    stored = load_file(path)
    for name, tensor in tensors.items():
        if tensor is None:
            del stored[name]
        else:
            stored[name] = tensor
    save_file(stored, path)


def refusals(lifecycle: Lifecycle, spec: Path | str) -> list[dict[str, Any]]:
    """Run ``lifecycle check --json`` on a refused ``spec``; return its refusals."""
    result = lifecycle("check", "--json", spec)
    assert result.returncode == 1, result.stdout + result.stderr
    found: list[dict[str, Any]] = json.loads(result.stdout)["refusals"]
    return found


class TestCorruptFolders:
    """Each corruption is a refusal with its code, or bad input (exit 2) naming the file."""

    def test_wrong_shape_tensor(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A tensor of another shape than the config builds is loader.weights_mismatch."""
        folder = copied(pipeline_folder("pixart"), tmp_path)
        edit_weights(folder / TRANSFORMER_WEIGHTS, **{"proj_out.weight": torch.zeros(3, 5)})
        (refusal,) = refusals(lifecycle, folder)
        assert (refusal["code"], refusal["component"]) == ("loader.weights_mismatch", "transformer")
        assert refusal["message"].startswith(
            f"the weights in {folder / 'transformer'} do not fit PixArtTransformer2DModel as its "
            "config.json builds it: "
        )
        assert "proj_out.weight" in refusal["message"]

    def test_missing_tensor(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A tensor the class expects and no file holds is loader.weights_mismatch."""
        folder = copied(pipeline_folder("sd3"), tmp_path)
        edit_weights(folder / TRANSFORMER_WEIGHTS, **{"proj_out.bias": None})
        (refusal,) = refusals(lifecycle, folder)
        assert (refusal["code"], refusal["component"]) == ("loader.weights_mismatch", "transformer")
        assert "proj_out.bias" in refusal["message"]

    def test_pickled_weights_only(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A component with only a pickled .bin is loader.unsafe_weights; the file is never read."""
        folder = copied(pipeline_folder("flux"), tmp_path)
        weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
        torch.save(load_file(weights), folder / "vae" / "diffusion_pytorch_model.bin")
        weights.unlink()
        (refusal,) = refusals(lifecycle, folder)
        assert (refusal["code"], refusal["component"]) == ("loader.unsafe_weights", "vae")
        assert "diffusion_pytorch_model.bin" in refusal["message"]

    def test_custom_code_entry(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """An entry naming a module shipped in the folder is pipeline.custom_code, never run."""
        folder = copied(pipeline_folder("flux"), tmp_path)
        edit_index(folder, transformer=["my_dit", "MyDit"])
        (folder / "transformer" / "my_dit.py").write_text("raise SystemExit('imported!')\n")
        (refusal,) = refusals(lifecycle, folder)
        assert (refusal["code"], refusal["component"]) == ("pipeline.custom_code", "transformer")

    def test_unsupported_class(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A pipeline class with no recipe is pipeline.unsupported_class, naming the supported."""
        folder = copied(pipeline_folder("sd3"), tmp_path)
        edit_index(folder, _class_name="StableDiffusionXLPipeline")
        (refusal,) = refusals(lifecycle, folder)
        assert refusal["code"] == "pipeline.unsupported_class"
        assert "supported: PixArtAlphaPipeline, PixArtSigmaPipeline" in refusal["message"]

    def test_mismatched_text_width(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A whole T5 narrower than the DiT's caption width is pipeline.interface_mismatch."""
        folder = copied(pipeline_folder("pixart"), tmp_path)
        encoder, _ = t5(DIMS["tiny"]._replace(text=32))
        shutil.rmtree(folder / "text_encoder")
        encoder.save_pretrained(folder / "text_encoder")
        (refusal,) = refusals(lifecycle, folder)
        assert refusal == {
            "component": "transformer",
            "trigger": "admit",
            "code": "pipeline.interface_mismatch",
            "message": "component 'transformer' reads context 64 wide, but 'text_encoder' "
            "writes it 32 wide",
            "hint": "pick components whose context widths agree (their config.json files)",
        }

    @pytest.mark.parametrize(
        "missing", ["vae", "vae/config.json", "scheduler/scheduler_config.json", "tokenizer"]
    )
    def test_missing_file_is_bad_input(
        self,
        missing: str,
        pipeline_folder: PipelineFolders,
        lifecycle: Lifecycle,
        tmp_path: Path,
    ) -> None:
        """A missing subfolder or file is exit 2 with the path it expected, at ``$.source``."""
        folder = copied(pipeline_folder("pixart"), tmp_path)
        gone = folder / missing
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
        result = lifecycle("check", "--json", folder)
        assert result.returncode == 2
        error = json.loads(result.stdout)["error"]
        assert error["path"] == "$.source"
        assert f"{gone} does not exist" in error["message"]
        plain = lifecycle("run", folder, "--prompt", "a fox")
        assert plain.returncode == 2
        assert f"{gone} does not exist" in plain.stderr
        assert "Traceback" not in plain.stderr


class TestLifecycleRules:
    """Residency, attention, layouts and dtypes on real components."""

    def spec(self, folder: Path, text: str) -> Any:
        """Return the spec over ``folder`` with ``text`` (TOML) added."""
        return decode_spec(f'source = "{folder}"\ndevice = "cpu"\n{text}\n')

    def native(self, folder: Path) -> str:
        """Return TOML that loads every component of ``folder`` through its native path."""
        names = load_spec(folder).components
        return "".join(f'[components.{name}]\nloader = "native"\n' for name in names)

    def codes(self, folder: Path, text: str, cpu: Platform) -> list[tuple[str, str]]:
        """Return (component, code) of each refusal admission gives the spec."""
        with pytest.raises(AdmissionRefused) as err:
            Orchestrator(self.spec(folder, text), platform=cpu).admit()
        return [(r.component, r.code.value) for r in err.value.refusals]

    def test_a_vae_has_no_blocks_to_stream(
        self, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """Layerwise offload of the VAE is residency.not_offloadable; its DiT streams."""
        folder = pipeline_folder("pixart")
        text = '[components.vae]\nresidency = "layerwise_offload"'
        assert self.codes(folder, text, cpu) == [("vae", "residency.not_offloadable")]
        admitted = '[components.transformer]\nresidency = "layerwise_offload"'
        Orchestrator(self.spec(folder, admitted), platform=cpu).admit()

    def test_explicit_backend_on_a_native_component(
        self, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """A native component cannot consume an explicit backend: never silently dropped.
        The custom DiT takes it."""
        text = '[components.transformer]\nattention_backend = "torch_flash"'
        native = f'{text}\nloader = "native"'
        assert self.codes(pipeline_folder("flux"), native, cpu) == [
            ("transformer", "loader.native_explicit_backend")
        ]
        Orchestrator(self.spec(pipeline_folder("flux"), text), platform=cpu).admit()

    @pytest.mark.parametrize("layout", ["tp_size = 2", "sp_degree = 2\nulysses_degree = 2"])
    def test_a_splitting_layout_is_refused(
        self, layout: str, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """Tensor or sequence parallel would split native components: each one is refused."""
        folder = pipeline_folder("sd3")
        codes = self.codes(folder, f"{self.native(folder)}[parallel]\n{layout}", cpu)
        assert {code for _, code in codes} == {"loader.native_parallel_layout"}
        assert {name for name, _ in codes} == set(load_spec(folder).components)

    @pytest.mark.parametrize("layout", ["dp_size = 2", "cfg_parallel = true"])
    def test_replicated_layouts_are_admitted(
        self, layout: str, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """Data and CFG parallel replicate every component: admitted natively; on the custom
        paths data parallel is, CFG parallel is not (no folder kind splits guidance branches:
        the recipes run both in one forward, so nothing would honour it)."""
        folder = pipeline_folder("sd3")
        layout = f"[parallel]\n{layout}"
        native = Orchestrator(self.spec(folder, self.native(folder) + layout), platform=cpu)
        assert {c.loader for c in native.admit().components.values()} == {"native"}
        if "cfg" in layout:
            assert self.codes(folder, layout, cpu) == [("sd3", "parallel.invalid_layout")]
            return
        alone = Orchestrator(self.spec(folder, ""), platform=cpu).admit().components
        plan = Orchestrator(self.spec(folder, layout), platform=cpu).admit()
        assert {n: c.loader for n, c in plan.components.items()} == {
            n: c.loader for n, c in alone.items()
        }

    @pytest.mark.parametrize("family", ["pixart", "flux"])
    def test_bfloat16_equals_diffusers_in_bfloat16(
        self, family: Family, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """``dtype = "bfloat16"`` loads half the bytes and, loaded natively, makes diffusers'
        bfloat16 image (our encoders' bfloat16 tolerance: tests/components/test_custom_paths)."""
        folder = pipeline_folder(family)
        request = Request(size=(32, 48), guidance_scale=3.5)
        batch = batch_of(request)
        text = f'dtype = "bfloat16"\n{self.native(folder)}'
        with Orchestrator(self.spec(folder, text), platform=cpu) as half:
            plan = half.admit()
            half.load()
            with half.request() as run:
                run.run_all(batch)
        full = Orchestrator(load_spec(folder), platform=cpu).admit()
        for name, component in plan.components.items():
            assert component.dtype == "bfloat16"
            whole = full.components[name].bytes
            assert component.bytes is not None
            assert whole is not None
            assert component.bytes < whole
        assert batch.images is not None
        assert batch.images.dtype == torch.bfloat16
        theirs = run_diffusers(folder, request, torch.bfloat16)
        assert torch.equal((batch.images / 2 + 0.5).clamp(0, 1), theirs)

    def test_a_dtype_a_kind_does_not_build_is_refused(self, cpu: Platform) -> None:
        """The tiny kinds build float32 only: bfloat16 asked of one is refused, not ignored."""
        spec = decode_spec('name = "t"\n[components.vae]\nkind = "tiny_vae"\ndtype = "bfloat16"\n')
        with pytest.raises(AdmissionRefused) as err:
            Orchestrator(spec, platform=cpu).admit()
        (refusal,) = err.value.refusals
        assert (refusal.code.value, refusal.message) == (
            "loader.unavailable",
            "component 'vae' is asked for in bfloat16, but kind 'tiny_vae' builds its weights "
            "in float32 only",
        )

    def test_requests_wait_for_memory_under_a_budget(
        self, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """Two requests under a budget of one stage take turns; each makes its own image."""
        folder = pipeline_folder("sd3")
        budget = largest_stage(load_spec(folder), cpu)
        offload = "".join(
            f'[components.{name}]\nresidency = "component_offload"\n'
            for name in load_spec(folder).components
        )
        spec = self.spec(folder, f"[memory]\ndevice_budget = {budget}\n{offload}")
        requests = [Request(seed=seed, size=(32, 32), steps=2) for seed in (4, 5)]
        batches = [batch_of(r) for r in requests]
        with Orchestrator(spec, platform=cpu) as orchestrator:
            orchestrator.load()

            def run(index: int) -> None:
                with orchestrator.request(f"r{index}") as request:
                    request.run_all(batches[index])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert orchestrator.resident_bytes() <= budget
        for request, batch in zip(requests, batches, strict=True):
            assert batch.images is not None
            ours = (batch.images / 2 + 0.5).clamp(0, 1)
            assert (ours - run_diffusers(folder, request)).abs().max() <= 1e-5
