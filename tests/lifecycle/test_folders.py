"""Pipelines from diffusers-format folders through the lifecycle: specs, check, run, refusals."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from attention import Platform
from benchmarks.make_pipeline import Family
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec, load_spec
from tests.components.folder_runs import KINDS, batch_of, run_diffusers
from tests.conftest import Lifecycle, PipelineFolders, decode_png
from tests.lifecycle.folder_specs import (
    MODES,
    REQUESTS,
    Mode,
    assert_same_pixels,
    mode_spec,
    pixels,
    run_arguments,
)
from tests.processes import run_python

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
"""Largest absolute pixel difference (images in [0, 1], float32, CPU) the issue allows."""


@pytest.fixture(scope="module")
def diffusers_images(pipeline_folder: PipelineFolders) -> dict[str, torch.Tensor]:
    """What diffusers' own pipeline makes of each family's request, in [0, 1], run once."""
    torch.set_num_threads(1)  # the module's first test is under one_thread too
    return {family: run_diffusers(pipeline_folder(family), r) for family, r in REQUESTS.items()}


def copied(folder: Path, into: Path) -> Path:
    """Copy pipeline ``folder`` into ``into`` (to corrupt it) and return the copy."""
    return shutil.copytree(folder, into / folder.name)


def check_json(lifecycle: Lifecycle, spec: Path) -> tuple[int, dict[str, object]]:
    """Run ``lifecycle check --json`` on ``spec``; return the exit code and the object."""
    result = lifecycle("check", "--json", spec)
    return result.returncode, json.loads(result.stdout)


class TestSpec:
    """A folder is a spec: its components and stages, the spec's overrides on top."""

    def test_a_folder_reads_as_a_spec(self, pipeline_folder: PipelineFolders) -> None:
        """Components with their kinds, the recipe's stages, named after the folder."""
        folder = pipeline_folder("flux")
        spec = load_spec(folder)
        assert (spec.name, spec.source) == ("flux", str(folder))
        assert {n: c.kind for n, c in spec.components.items()} == KINDS["flux"]
        assert [(s.name, s.uses) for s in spec.stages] == [
            ("encode", ("text_encoder", "text_encoder_2")),
            ("denoise", ("transformer",)),
            ("decode", ("vae",)),
        ]
        assert spec.components["vae"].options == {
            "path": str(folder / "vae"),
            "class_name": "AutoencoderKL",
        }

    def test_overrides_and_a_path_relative_to_the_spec(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """``source`` is read beside the spec; residency, dtype and options apply on top."""
        folder = copied(pipeline_folder("pixart"), tmp_path)
        path = tmp_path / "spec.toml"
        path.write_text(
            'name = "mine"\nsource = "pixart"\ndtype = "bfloat16"\n'
            '[components.vae]\nresidency = "component_offload"\ndtype = "float32"\n'
        )
        spec = load_spec(path)
        assert (spec.name, spec.source) == ("mine", str(folder))
        assert spec.components["vae"].residency == "component_offload"
        assert (spec.dtype_of("vae"), spec.dtype_of("transformer")) == ("float32", "bfloat16")
        assert spec.components["vae"].options["path"] == str(folder / "vae")

    def test_the_printed_spec_reads_back_the_same(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``lifecycle spec FOLDER`` prints TOML that decodes to the very same spec."""
        folder = pipeline_folder("sd3")
        result = lifecycle("spec", folder)
        assert result.returncode == 0
        assert f'source = "{folder}"' in result.stdout
        assert decode_spec(result.stdout) == load_spec(folder)

    @pytest.mark.parametrize(
        ("text", "path", "message"),
        [
            (
                '[components.unet]\nresidency = "resident"',
                "$.components.unet",
                "Expected a component of the folder (text_encoder, transformer, vae), got 'unet'",
            ),
            (
                '[components.vae]\nkind = "tiny_vae"',
                "$.components.vae.kind",
                "Expected kind 'autoencoder_kl' (the folder's 'vae' is of class AutoencoderKL), "
                "got 'tiny_vae'; remove the key: the folder names the class",
            ),
            (
                '[[stages]]\nname = "decode"\nuses = ["vae"]',
                "$.stages",
                "Expected the stages of the folder's PixArtAlphaPipeline (encode [text_encoder] "
                "-> denoise [transformer] -> decode [vae]), got others; remove [[stages]]: a "
                "folder's pipeline class sets them",
            ),
            (
                '[components.vae]\ndtype = "float64"',
                "$.components.vae.dtype",
                "Expected `bfloat16 | float16 | float32`, got 'float64'",
            ),
        ],
    )
    def test_what_the_folder_does_not_have_is_bad_input(
        self, pipeline_folder: PipelineFolders, text: str, path: str, message: str
    ) -> None:
        """A component, kind or stage the folder does not have is a ConfigError at its key."""
        folder = pipeline_folder("pixart")
        with pytest.raises(ConfigError) as err:
            decode_spec(f'source = "{folder}"\n{text}\n')
        assert (err.value.path, err.value.message) == (path, message)


class TestCheck:
    """``check --json`` on a folder: its components, kinds, bytes from headers, stages."""

    @pytest.mark.parametrize("family", list(KINDS))
    def test_check_lists_what_a_load_holds(
        self, family: Family, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, cpu: Platform
    ) -> None:
        """The bytes read from the headers are the bytes the loaded modules hold."""
        folder = pipeline_folder(family)
        code, report = check_json(lifecycle, folder)
        assert code == 0
        components = report["components"]
        assert isinstance(components, dict)
        assert {name: c["kind"] for name, c in components.items()} == KINDS[family]
        assert report["stages"] == {
            stage.name: list(stage.uses) for stage in load_spec(folder).stages
        }
        with Orchestrator(load_spec(folder), platform=cpu) as orchestrator:
            orchestrator.load()
            held = {name: _bytes(orchestrator.module(name)) for name in components}
        assert {name: c["bytes"] for name, c in components.items()} == held


@contextmanager
def parameters_registered() -> Iterator[list[str]]:
    """Yield the names of the parameters modules register inside the block, in order: one
    per parameter each time a module is built (torch's module-wide registration hook)."""
    names: list[str] = []

    def note(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        if parameter is not None:
            names.append(name)

    handle = register_module_parameter_registration_hook(note)
    try:
        yield names
    finally:
        handle.remove()


class TestLoad:
    """Admission and load build each component's module once."""

    @pytest.mark.parametrize("family", ["pixart", "flux", "sd3"])
    def test_admit_and_load_build_each_module_once(
        self, family: Family, pipeline_folder: PipelineFolders, cpu: Platform, tmp_path: Path
    ) -> None:
        """The module admission builds on meta to declare its tensors is the one the load
        fills: as many parameters are registered as the loaded modules hold."""
        spec = load_spec(copied(pipeline_folder(family), tmp_path))  # admitted by no other test
        with parameters_registered() as registered, Orchestrator(spec, platform=cpu) as loaded:
            loaded.admit()
            loaded.load()
            held = [len(list(loaded.module(name).parameters())) for name in spec.components]
        assert len(registered) == sum(held)

    def test_a_folder_admitted_again_is_not_built_again(
        self, pipeline_folder: PipelineFolders, cpu: Platform, tmp_path: Path
    ) -> None:
        """A later admission of the folder in the process takes the layouts the first one
        declared and builds no module; the next load fills the modules that admission
        built (whichever orchestrator made it), a load after it builds each once; an
        edited config is a new layout, built again."""
        folder = copied(pipeline_folder("pixart"), tmp_path)  # admitted by no earlier test
        spec = load_spec(folder)
        with Orchestrator(spec, platform=cpu) as first:
            first.admit()
        loads = []
        for _ in range(2):
            with parameters_registered() as registered, Orchestrator(spec, platform=cpu) as again:
                again.admit()
                admitted = len(registered)
                again.load()
                held = {n: len(list(again.module(n).parameters())) for n in spec.components}
            loads.append((admitted, len(registered)))
        assert loads == [(0, 0), (0, sum(held.values()))]
        assert all(held.values())
        config = folder / "vae" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "_note": "edited"}))
        with parameters_registered() as registered, Orchestrator(spec, platform=cpu) as edited:
            edited.admit()
        assert len(registered) == held["vae"]


def _bytes(module: torch.nn.Module) -> int:
    """Return the bytes of ``module``'s parameters and buffers, each tensor once."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class TestEqualToDiffusers:
    """Every residency mode makes diffusers' image, through the Python API and ``run``."""

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("family", list(REQUESTS))
    def test_python_api(
        self,
        family: Family,
        mode: Mode,
        pipeline_folder: PipelineFolders,
        diffusers_images: dict[str, torch.Tensor],
        tmp_path: Path,
        cpu: Platform,
    ) -> None:
        """A request through the orchestrator equals diffusers within 1e-5; budgets evict."""
        spec = load_spec(mode_spec(pipeline_folder(family), mode, tmp_path, cpu))
        moves: list[Move] = []
        batch = batch_of(REQUESTS[family])
        with Orchestrator(spec, platform=cpu, observer=_moves(moves)) as orchestrator:
            orchestrator.load()
            with orchestrator.request() as request:
                request.run_all(batch)
        assert batch.images is not None
        ours = (batch.images / 2 + 0.5).clamp(0, 1)
        assert (ours - diffusers_images[family]).abs().max() <= TOLERANCE
        if mode == "budget":
            assert any(m.direction == "offload" and m.request_id for m in moves)

    @pytest.mark.parametrize(
        ("family", "mode"),
        [
            ("pixart", "resident"),
            ("pixart-sigma", "host"),
            ("flux", "disk"),
            ("sd3", "layerwise"),
            ("flux", "budget"),
            ("sd3", "resident"),
            ("qwen-image", "layerwise"),
            ("z-image", "host"),
            ("flux2-klein", "budget"),
            ("flux2-klein-distilled", "resident"),
        ],
    )
    def test_run_writes_diffusers_pixels(
        self,
        family: Family,
        mode: Mode,
        pipeline_folder: PipelineFolders,
        diffusers_images: dict[str, torch.Tensor],
        lifecycle: Lifecycle,
        tmp_path: Path,
        cpu: Platform,
    ) -> None:
        """``lifecycle run`` writes the PNG of diffusers' image, pixel for pixel (each class,
        each mode: the Python API above runs every pair)."""
        spec = mode_spec(pipeline_folder(family), mode, tmp_path, cpu)
        out = tmp_path / "out"
        arguments = run_arguments(REQUESTS[family])
        result = lifecycle("run", spec, *arguments, "--requests", "1", "--out", out)
        assert result.returncode == 0, result.stderr
        assert_same_pixels(
            decode_png((out / "r1-0.png").read_bytes()), pixels(diffusers_images[family])[0]
        )

    def test_request_i_is_seeded_seed_plus_i(
        self,
        pipeline_folder: PipelineFolders,
        diffusers_images: dict[str, torch.Tensor],
        lifecycle: Lifecycle,
        tmp_path: Path,
    ) -> None:
        """``--seed N --requests 2``: the second image is diffusers' with seed N + 1."""
        request = REQUESTS["flux"]
        arguments = run_arguments(request._replace(seed=request.seed - 1))
        folder = pipeline_folder("flux")
        result = lifecycle("run", folder, *arguments, "--requests", "2", "--out", tmp_path)
        assert result.returncode == 0, result.stderr
        assert_same_pixels(
            decode_png((tmp_path / "r2-0.png").read_bytes()), pixels(diffusers_images["flux"])[0]
        )
        assert not torch.equal(
            decode_png((tmp_path / "r1-0.png").read_bytes()),
            decode_png((tmp_path / "r2-0.png").read_bytes()),
        )


class TestQuiet:
    def test_a_folder_load_prints_no_progress_bar(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """``lifecycle run`` of a folder with every component on the libraries' own classes
        (transformers' T5, diffusers' DiT and VAE) prints no progress bar, in a process of
        its own: the libraries' switches as they are when nothing set them."""
        folder = pipeline_folder("pixart")
        native = "".join(
            f'[components.{name}]\nloader = "native"\n' for name in load_spec(folder).components
        )
        spec = tmp_path / "native.toml"
        spec.write_text(f'source = "{folder}"\n\n{native}')
        # one thread: the bars do not depend on it, and two spin against the other worker
        result = run_python(
            "lifecycle", "run", spec, "--prompt", "a red fox", "--requests", "1", "--steps", "1",
            "--threads", "1", cwd=tmp_path, module=True,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "pipeline 'pixart': 1 request x 1 step" in result.stdout
        for printed in (result.stdout, result.stderr):  # a tqdm bar: "desc:  50%|#####  | 1/2"
            assert "%|" not in printed, printed


def _moves(moves: list[Move]) -> Callable[[Event], None]:
    def observe(event: Event) -> None:
        if isinstance(event, Move):
            moves.append(event)

    return observe
