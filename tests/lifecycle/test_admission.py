"""Admission of whole pipelines: plans, every refusal at once, native-fallback rules."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from attention import Platform, Provenance, SelectionCode
from components import registry
from components.loader import ComponentLoader
from lifecycle.admission import admit_pipeline
from lifecycle.admission.host_memory import available_host_bytes, held_at_once, host_memory_refusals
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import REFUSAL_CODES, AdmissionRefused, RefusalCode
from lifecycle.spec.reading import decode_spec, load_spec
from lifecycle.spec.structs import PipelineSpec
from tests.blocked_imports import blocking
from tests.components.fills import Fills
from tests.conftest import Lifecycle
from tests.lifecycle.conftest import ReferenceSpec
from tests.lifecycle.kinds_for_tests import ValueDependentKind
from tests.plugin.ext import SequentialStackKind
from tests.processes import run_python

CHECK_JSON = """
import sys

from lifecycle.cli.entry import main

sys.exit(main(["check", "--json", sys.argv[1]]))
"""
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REFUSED = sorted((EXAMPLES / "refused").glob("*.toml"))
ADMITTED = sorted(EXAMPLES.glob("*.toml"))


def expected_code(path: Path) -> str:
    """Return the code an example spec declares on its ``# expect:`` line."""
    match = re.match(r"# expect: (\S+)", path.read_text())
    assert match is not None, f"{path} has no '# expect: <code>' first line"
    return match.group(1)


def needs_of(path: Path) -> tuple[dict[str, str], list[str]]:
    """Return what an example is refused under: its ``# run with: NAME=VALUE ...`` variables
    and the packages of its ``# run without: PACKAGE ...`` line (a machine that lacks them)."""
    text = path.read_text()
    env = re.search(r"^# run with: (.+)$", text, re.MULTILINE)
    without = re.search(r"^# run without: (.+)$", text, re.MULTILINE)
    pairs = dict(item.split("=", 1) for item in env.group(1).split()) if env else {}
    return pairs, without.group(1).split() if without else []


class TestExamples:
    @pytest.mark.parametrize("path", ADMITTED, ids=lambda p: p.name)
    def test_every_example_is_admitted(self, cpu: Platform, path: Path) -> None:
        """Each runnable example spec is admitted on a cpu platform."""
        admission = admit_pipeline(load_spec(path), cpu)
        assert admission.refusals() == ()

    @pytest.mark.parametrize("path", REFUSED, ids=lambda p: p.stem)
    def test_each_refused_example_gives_its_code(
        self, cpu: Platform, path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each example under examples/refused/ is refused with exactly the code it names
        (where it says so, under its variables, or by `check --json` in a process that
        cannot import the packages it names)."""
        env, without = needs_of(path)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        if without:
            program = blocking(*without) + CHECK_JSON
            done = run_python(program, path, cwd=path.parent)
            assert done.returncode == 1, done.stderr
            refusals = json.loads(done.stdout)["refusals"]
            assert {r["code"] for r in refusals} == {expected_code(path)}
            assert all(r["hint"] for r in refusals)
            return
        admission = admit_pipeline(load_spec(path), cpu)
        codes = {r.code for r in admission.refusals()}
        assert codes == {expected_code(path)}
        assert all(r.hint for r in admission.refusals())

    def test_a_component_folder_that_is_missing_is_refused_not_raised(
        self, root: Path, tmp_path: Path, lifecycle: Lifecycle
    ) -> None:
        """An example whose component folder is not where the spec says (moved away from
        its folders) is refused by ``check --json`` as loader.unavailable, no traceback:
        the interface check skips a component no path was admitted for."""
        moved = tmp_path / "native_cache_method.toml"
        moved.write_text((root / "examples" / "refused" / "native_cache_method.toml").read_text())
        result = lifecycle("check", "--json", moved)
        assert result.returncode == 1, result.stderr
        refusals = json.loads(result.stdout)["refusals"]
        assert {r["code"] for r in refusals} == {"loader.unavailable"}

    def test_refused_examples_cover_every_admission_code(self) -> None:
        """Every code admission can raise from a spec has an example that teaches it (a code
        refused for several reasons may have one per reason), and no example expects another."""
        from_spec = {code.value for code in RefusalCode if code.from_spec}
        assert {expected_code(p) for p in REFUSED} == from_spec


class TestRefusalCodes:
    def test_attention_codes_are_refusal_codes(self) -> None:
        """Each code attention raises is the RefusalCode of the same name and value."""
        for code in SelectionCode:
            assert RefusalCode[code.name].value == code.value

    def test_codes_are_dotted_and_documented(self) -> None:
        """Every code is wing.snake_case and says what it means."""
        for code in RefusalCode:
            assert re.fullmatch(r"[a-z]+\.[a-z_]+", code.value)
            assert code.__doc__
            assert REFUSAL_CODES[code.value] == code.__doc__


class TestPlan:
    def test_reference_plan(self, cpu: Platform, root: Path) -> None:
        """The reference pipeline's plan says which backend each site runs, and why."""
        plan = Orchestrator(load_spec(root / "examples" / "tiny_t2i.toml"), platform=cpu).admit()
        vae = plan.components["vae"]
        assert (vae.loader, [(s.site, s.backend, s.reason) for s in vae.attention]) == (
            "custom",
            [("mid", "torch_sdpa", None)],
        )
        sites = {s.site: s for s in plan.components["transformer"].attention}
        # torch_sdpa, the cpu default, has no varlen kernel: the packed DiT falls back
        assert sites["self"].backend == "torch_flash"
        assert sites["self"].reason == "platform default fallback"
        assert sites["self"].provenance is Provenance.DEFAULT
        assert sites["cross"].backend == "torch_sdpa"
        assert sites["cross"].reason is None

    def test_explicit_global_backend_falls_back_where_allowed(self, cpu: Platform) -> None:
        """A global backend the VAE cannot serve falls back to its default; the DiT takes it."""
        spec = decode_spec(
            """
name = "p"
device = "cpu"
attention.backend = "reference"
[components.vae]
kind = "tiny_vae"
[components.transformer]
kind = "tiny_dit"
"""
        )
        plan = Orchestrator(spec, platform=cpu).admit()
        (mid,) = plan.components["vae"].attention
        assert (mid.backend, mid.reason, mid.provenance) == (
            "torch_sdpa",
            "global backend fallback",
            Provenance.EXPLICIT,
        )
        assert {s.backend for s in plan.components["transformer"].attention} == {"reference"}

    @pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
    def test_cuda_device_without_cuda_is_refused(self) -> None:
        """Asking for CUDA in a process without it is refused before anything loads."""
        spec = decode_spec('name = "p"\ndevice = "cuda"\n[components.vae]\nkind = "tiny_vae"\n')
        admission = admit_pipeline(spec, Platform("cuda"))
        assert [r.code for r in admission.refusals()] == ["loader.unavailable"]
        assert "sees no CUDA device" in admission.refusals()[0].message

    def test_all_shadowed_by_role_keys_is_not_consumed(self, cpu: Platform) -> None:
        """An ``all`` backend that role keys replace for every role the VAE builds is refused."""
        spec = decode_spec(
            'name = "p"\n[components.vae]\nkind = "tiny_vae"\n'
            'attention_backend = { all = "torch_sdpa", self = "torch_flash" }\n'
        )
        (refusal,) = admit_pipeline(spec, cpu).refusals()
        assert refusal.code == "attention.backend_not_consumed"
        assert refusal.message == (
            "backend 'torch_sdpa' was requested for component 'vae', but that component "
            "constructed no cross-attention layers (only self), and per-role overrides "
            "replace it for self-attention layers"
        )

    def test_component_backend_replaced_for_every_role(self, cpu: Platform) -> None:
        """A component-wide backend that role keys replace for every role says so plainly."""
        spec = decode_spec(
            'name = "p"\n[components.dit]\nkind = "tiny_dit"\n'
            "[components.dit.options]\npacked_sequences = false\n"
            "[components.dit.attention_backend]\n"
            'all = "reference"\nself = "torch_sdpa"\ncross = "torch_sdpa"\n'
        )
        (refusal,) = admit_pipeline(spec, cpu).refusals()
        assert refusal.code is RefusalCode.BACKEND_NOT_CONSUMED
        assert refusal.message == (
            "backend 'reference' was requested for component 'dit', but per-role "
            "overrides replace it for every role"
        )

    def test_layerwise_settings_the_stack_cannot_honour(self, cpu: Platform) -> None:
        """resident_layers beyond the declared blocks is refused by check, naming the key."""
        spec = decode_spec(
            'name = "p"\n[components.te]\nkind = "tiny_text_encoder"\n'
            'residency = "layerwise_offload"\n[components.te.layerwise]\nresident_layers = 5\n'
            '[[stages]]\nname = "s"\nuses = ["te"]\n'
        )
        (refusal,) = admit_pipeline(spec, cpu).refusals()
        assert refusal.code is RefusalCode.INVALID_LAYERWISE
        assert refusal.component == "te"
        assert refusal.message == (
            "component 'te' streams 2 blocks (kind 'tiny_text_encoder'), and its layerwise "
            "settings cannot be honoured: resident_layers is 5; use 0 to 2"
        )
        assert refusal.hint == "change [components.te.layerwise] to fit 2 blocks"

    def test_options_of_a_backend_nobody_runs_are_refused(self, cpu: Platform) -> None:
        """Backend options that no planned site would use are not dropped in silence."""
        spec = decode_spec(
            'name = "p"\n[attention.backend_options.sliding_window]\nwindow = 64\n'
            '[components.vae]\nkind = "tiny_vae"\n'
        )
        (refusal,) = admit_pipeline(spec, cpu).refusals()
        assert refusal.code == "attention.backend_not_consumed"
        assert "[attention.backend_options.sliding_window]" in refusal.message

    def test_options_of_a_planned_backend_pass(self, cpu: Platform) -> None:
        """Options for the backend a site will run are admitted."""
        spec = decode_spec(
            'name = "p"\n[attention.backend_options.sliding_window]\nwindow = 64\n'
            '[components.transformer]\nkind = "tiny_dit"\n'
            'attention_backend = { self = "sliding_window" }\n'
            "options = { packed_sequences = false }\n"
        )
        assert admit_pipeline(spec, cpu).refusals() == ()

    def test_missing_weights_file_is_refused(self, cpu: Platform, tmp_path: Path) -> None:
        """A weights file that does not exist is a loader refusal, also under a budget."""
        missing = tmp_path / "absent.safetensors"
        spec = decode_spec(
            f'name = "p"\nmemory.device_budget = "1GiB"\n[components.vae]\nkind = "tiny_vae"\n'
            f'options = {{ weights = "{missing}" }}\n'
        )
        (refusal,) = admit_pipeline(spec, cpu).refusals()
        assert refusal.code == "loader.unavailable"
        assert f"its weights file '{missing}' does not exist" in refusal.message

    def test_no_backend_when_every_candidate_is_unavailable(self) -> None:
        """With every backend the VAE supports banned, admission says none is left."""
        platform = Platform("cpu", unavailable={"torch_sdpa": "banned", "torch_flash": "banned"})
        spec = decode_spec('name = "p"\n[components.vae]\nkind = "tiny_vae"\n')
        admission = admit_pipeline(spec, platform)
        assert [r.code for r in admission.refusals()] == ["attention.no_backend"]


def layerwise_spec(kind: str, loader: str = "custom") -> str:
    """Return a one-component pipeline that streams ``kind`` layerwise through ``loader``."""
    return (
        f'name = "p"\n[components.c]\nkind = "{kind}"\nloader = "{loader}"\n'
        'residency = "layerwise_offload"\n[[stages]]\nname = "s"\nuses = ["c"]\n'
    )


def test_meta_builds_draw_no_random_values(cpu: Platform) -> None:
    """Admission builds a streamed DiT on the meta device without running an initialiser."""
    spec = decode_spec(layerwise_spec("tiny_dit"))
    with Fills() as fills:
        admission = admit_pipeline(spec, cpu)
    assert admission.refusals() == ()
    assert fills.filled == []


class TestLayerwiseStack:
    @pytest.fixture(autouse=True)
    def kinds(self) -> Iterator[None]:
        """Register the kinds whose block stacks are wrong for one test, then forget them."""
        for kind in (SequentialStackKind, ValueDependentKind):
            registry.register_kind(kind)
        yield
        for kind in (SequentialStackKind, ValueDependentKind):
            registry.unregister_kind(kind.kind)

    def test_stack_that_is_no_module_list_is_refused(self, cpu: Platform) -> None:
        """A declared block stack built as a Sequential is refused, never moved whole."""
        spec = decode_spec(layerwise_spec("plugin_sequential_stack"))
        (refusal,) = admit_pipeline(spec, cpu).refusals()
        assert refusal.code is RefusalCode.NOT_OFFLOADABLE
        assert refusal.message == (
            "component 'c' asks for layerwise_offload, but kind 'plugin_sequential_stack' builds "
            "its block stack 'blocks' as a Sequential, not an nn.ModuleList: layerwise offload "
            "streams the blocks of an nn.ModuleList; make it one, or use component_offload"
        )
        assert refusal.hint == 'use residency = "component_offload" for c'

    def test_stack_that_admission_cannot_build_is_refused_with_why(self, cpu: Platform) -> None:
        """A kind that cannot be built on the meta device is refused, with what it raised."""
        spec = decode_spec(layerwise_spec("test_value_dependent"))
        (refusal,) = admit_pipeline(spec, cpu).refusals()
        assert refusal.code is RefusalCode.NOT_OFFLOADABLE
        assert refusal.message.startswith(
            "component 'c' asks for layerwise_offload, but building kind 'test_value_dependent' "
            "on the meta device to find its block stack failed (RuntimeError: "
        )

    @pytest.mark.parametrize(
        ("kind", "loader"),
        [(k, p) for k in ("tiny_text_encoder", "tiny_dit") for p in ("custom", "native")],
    )
    def test_reference_stacks_are_admitted(self, cpu: Platform, kind: str, loader: str) -> None:
        """The reference kinds' stacks are ModuleLists on both paths: layerwise is admitted."""
        assert admit_pipeline(decode_spec(layerwise_spec(kind, loader)), cpu).refusals() == ()


class TestRefusalsTogether:
    SPEC = """
name = "many"
device = "cpu"
[parallel]
sp_degree = 2
[components.text_encoder]
kind = "tiny_text_encoder"
loader = "native"
attention_backend = "torch_flash"
[components.vae]
kind = "tiny_vae"
residency = "component_offload"
attention_backend = "reference"
[components.upsampler]
kind = "tiny_upsampler"
"""

    def test_every_reason_of_every_component_at_once(self, cpu: Platform) -> None:
        """One admission reports the layout, the native path and the VAE's two problems."""
        orchestrator = Orchestrator(decode_spec(self.SPEC), platform=cpu)
        with pytest.raises(AdmissionRefused) as err:
            orchestrator.admit()
        by_component = sorted((r.component, r.code) for r in err.value.refusals)
        assert by_component == [
            ("many", "parallel.invalid_layout"),
            ("text_encoder", "loader.native_explicit_backend"),
            ("text_encoder", "loader.native_parallel_layout"),
            ("vae", "attention.unsupported_backend"),
            ("vae", "residency.undeclared_use"),
        ]
        assert all(orchestrator.state(n) is ComponentState.CONFIGURED for n in ("vae", "upsampler"))

    def test_check_json_reports_them(self, root: Path, lifecycle: Lifecycle) -> None:
        """``lifecycle check --json`` prints the contract's object with every refusal, exit 1."""
        path = root / "examples" / "refused" / "unsupported_backend.toml"
        result = lifecycle("check", "--json", path)
        assert result.returncode == 1
        report = json.loads(result.stdout)
        assert list(report) == [
            "pipeline",
            "admitted",
            "components",
            "refusals",
            "stages",
            "source",
            "revision",
            "adapters",
        ]
        assert report["admitted"] is False
        assert report["components"]["vae"] == {
            "kind": "tiny_vae",
            "state": "configured",
            "loader": "custom",
            "residency": "resident",
            "attention": [],
            "dtype": "float32",
            "bytes": 248588,
            "users": ["unsupported-backend"],
            "cache": None,
            "compile": "off",
            "quantization": "off",
        }
        (refusal,) = report["refusals"]
        assert list(refusal) == ["component", "trigger", "code", "message", "hint"]
        assert refusal["code"] == "attention.unsupported_backend"
        assert refusal["trigger"] == "admit"
        assert "supported: [torch_flash, torch_sdpa]" in refusal["message"]


def disk_spec(
    offload_dir: Path | str, *, target: str = "disk", residency: str = "component_offload"
) -> PipelineSpec:
    """Return a one-VAE spec offloading to ``target`` under ``offload_dir``."""
    return decode_spec(
        f'name = "p"\ndevice = "cpu"\n[memory]\noffload_target = "{target}"\n'
        f'offload_dir = "{offload_dir}"\n[components.vae]\nkind = "tiny_vae"\n'
        f'residency = "{residency}"\n[[stages]]\nname = "decode"\nuses = ["vae"]\n'
    )


class TestOffloadDir:
    @pytest.mark.parametrize(
        ("where", "why"),
        [
            (lambda tmp: tmp / ("x" * 300), "File name too long"),
            (lambda tmp: Path("/sys/lifecycle-offload"), "Operation not permitted"),
            (lambda tmp: tmp / "file", "is a file, not a folder"),
            (lambda tmp: tmp / "file" / "offload", "Not a directory"),
        ],
        ids=["name-too-long", "under-sys", "file-in-the-way", "file-as-parent"],
    )
    def test_unusable_folder_is_refused_and_nothing_is_left(
        self, cpu: Platform, tmp_path: Path, where: Callable[[Path], Path], why: str
    ) -> None:
        """A folder that cannot be made is refused with the file system's answer and the fix."""
        if str(where(tmp_path)).startswith("/sys") and not Path("/sys/kernel").is_dir():
            pytest.skip("no sysfs here")
        (tmp_path / "file").write_text("in the way")
        root = where(tmp_path)
        (refusal,) = admit_pipeline(disk_spec(root), cpu).refusals()
        assert (refusal.code, refusal.component) == ("residency.offload_dir_unusable", "p")
        assert refusal.message.startswith(
            f"memory.offload_dir '{root}' cannot hold the offload files of vae: "
        )
        assert why in refusal.message
        assert refusal.hint.startswith("set memory.offload_dir to a folder this process can")
        assert sorted(tmp_path.iterdir()) == [tmp_path / "file"]

    @pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
    def test_folder_without_permission_is_refused(self, cpu: Platform, tmp_path: Path) -> None:
        """A folder under one this process may not write is refused: permission denied."""
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        (refusal,) = admit_pipeline(disk_spec(locked / "offload"), cpu).refusals()
        assert refusal.code == "residency.offload_dir_unusable"
        assert "Permission denied" in refusal.message

    def test_usable_folder_is_admitted_and_left_as_found(
        self, cpu: Platform, tmp_path: Path
    ) -> None:
        """Missing folders are made and removed again; an existing one keeps only its files."""
        assert admit_pipeline(disk_spec(tmp_path / "a" / "b" / "offload"), cpu).admitted
        assert list(tmp_path.iterdir()) == []
        (tmp_path / "kept").mkdir()
        (tmp_path / "kept" / "other").write_text("someone else's")
        assert admit_pipeline(disk_spec(tmp_path / "kept"), cpu).admitted
        assert list((tmp_path / "kept").iterdir()) == [tmp_path / "kept" / "other"]

    @pytest.mark.parametrize(
        ("target", "residency"), [("host", "component_offload"), ("disk", "resident")]
    )
    def test_folder_is_not_tried_when_nothing_goes_to_disk(
        self, cpu: Platform, tmp_path: Path, target: str, residency: str
    ) -> None:
        """A host target, or only resident components, never writes there: no refusal."""
        spec = disk_spec(tmp_path / ("x" * 300), target=target, residency=residency)
        assert admit_pipeline(spec, cpu).admitted

    def test_admit_refuses_and_every_component_stays_configured(
        self, cpu: Platform, tmp_path: Path
    ) -> None:
        """Orchestrator.admit() raises the refusal; nothing moved, nothing was written."""
        (tmp_path / "file").write_text("in the way")
        orchestrator = Orchestrator(disk_spec(tmp_path / "file"), platform=cpu)
        with pytest.raises(AdmissionRefused) as err:
            orchestrator.admit()
        assert err.value.codes == ("residency.offload_dir_unusable",)
        assert orchestrator.state("vae") is ComponentState.CONFIGURED


T2I_BYTES = {"text_encoder": 138240, "transformer": 170384, "vae": 248588}
"""The declared bytes of the reference pipeline's components (default options)."""


class TestHostMemory:
    def test_declared_bytes_are_the_kinds(self) -> None:
        """The sizes these tests rely on are what the kinds declare."""
        kinds = {"text_encoder": "tiny_text_encoder", "transformer": "tiny_dit", "vae": "tiny_vae"}
        assert {
            name: registry.get(kind).from_options({}).declared_bytes()
            for name, kind in kinds.items()
        } == T2I_BYTES

    def test_host_target_holds_every_component(self, reference_spec: ReferenceSpec) -> None:
        """With the host target every component counts, offloaded or not."""
        spec = reference_spec("host")
        assert held_at_once(spec, loaders(spec)) == T2I_BYTES

    def test_disk_target_holds_residents_and_the_largest_offloaded(
        self, reference_spec: ReferenceSpec
    ) -> None:
        """With the disk target the resident DiT counts, and the VAE, the larger offloaded one."""
        spec = reference_spec("disk")
        assert held_at_once(spec, loaders(spec)) == {
            "transformer": T2I_BYTES["transformer"],
            "vae": T2I_BYTES["vae"],
        }

    def test_refused_one_byte_short_with_the_numbers(self, reference_spec: ReferenceSpec) -> None:
        """One byte fewer than needed is refused, naming the sizes and the fix; enough passes."""
        spec = reference_spec("host")
        needed = sum(T2I_BYTES.values())
        assert host_memory_refusals(spec, loaders(spec), needed) == []
        (refusal,) = host_memory_refusals(spec, loaders(spec), 100 * 1024)
        assert (refusal.code, refusal.component) == ("residency.host_memory", "tiny-t2i")
        assert refusal.message == (
            "the host holds every component at once: 544.2 KiB (vae 242.8 KiB, transformer "
            "166.4 KiB, text_encoder 135.0 KiB), and it has 100.0 KiB available"
        )
        assert refusal.hint == (
            "make vae smaller (components.vae.options), keep vae on disk "
            '(memory.offload_target = "disk" and components.vae.residency = '
            '"component_offload"), or run where at least 544.2 KiB of memory is available'
        )
        assert len(host_memory_refusals(spec, loaders(spec), needed - 1)) == 1

    def test_no_refusal_without_a_reading(self, reference_spec: ReferenceSpec) -> None:
        """Where the host's memory is unknown, nothing is refused."""
        spec = reference_spec("host")
        assert host_memory_refusals(spec, loaders(spec), None) == []

    def test_cuda_admission_refuses_too(self, reference_spec: ReferenceSpec) -> None:
        """On CUDA the host keeps every component's master copy: a CUDA platform refuses too."""
        spec = load_spec(EXAMPLES / "refused" / "host_memory.toml")
        assert [r.code for r in admit_pipeline(spec, Platform("cuda")).refusals()] == [
            "residency.host_memory"
        ]

    def test_available_bytes_come_from_meminfo(self, tmp_path: Path) -> None:
        """MemAvailable (kB) is read; without the file free pages are counted instead."""
        meminfo = tmp_path / "meminfo"
        meminfo.write_text("MemTotal:  9000 kB\nMemFree:  10 kB\nMemAvailable:  1234 kB\n")
        assert available_host_bytes(meminfo) == 1234 * 1024
        fallback = available_host_bytes(tmp_path / "absent")
        assert fallback is not None
        assert fallback > 0

    def test_a_million_wide_dit_is_refused_by_admit(self, cpu: Platform) -> None:
        """The fuzzer's dim = 1000000 DiT is refused by admit(), not at load; nothing moves."""
        orchestrator = Orchestrator(
            load_spec(EXAMPLES / "refused" / "host_memory.toml"), platform=cpu
        )
        with pytest.raises(AdmissionRefused) as err:
            orchestrator.admit()
        (refusal,) = err.value.refusals
        assert refusal.code == "residency.host_memory"
        assert "transformer 101.9 TiB" in refusal.message
        assert orchestrator.state("transformer") is ComponentState.CONFIGURED


def loaders(spec: PipelineSpec) -> dict[str, ComponentLoader]:
    """Return each component's loader, as admission makes them."""
    return {
        name: registry.get(component.kind).from_options(component.options)
        for name, component in spec.components.items()
    }
