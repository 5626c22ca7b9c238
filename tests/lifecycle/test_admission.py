"""Admission of whole pipelines: plans, every refusal at once, native-fallback rules."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention import Platform, Provenance
from lifecycle.admission import admit_pipeline
from lifecycle.config import decode_spec, load_spec
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import REFUSAL_CODES, AdmissionRefused
from lifecycle.states import ComponentState

ROOT = Path(__file__).resolve().parents[2]
CPU = Platform("cpu")
REFUSED = sorted((ROOT / "examples" / "refused").glob("*.toml"))
ADMITTED = sorted((ROOT / "examples").glob("*.toml"))


def expected_code(path: Path) -> str:
    """Return the code an example spec declares on its ``# expect:`` line."""
    match = re.match(r"# expect: (\S+)", path.read_text())
    assert match is not None, f"{path} has no '# expect: <code>' first line"
    return match.group(1)


class TestExamples:
    @pytest.mark.parametrize("path", ADMITTED, ids=lambda p: p.name)
    def test_every_example_is_admitted(self, path: Path) -> None:
        """Each runnable example spec is admitted on a CPU platform."""
        admission = admit_pipeline(load_spec(path), CPU)
        assert admission.refusals() == ()

    @pytest.mark.parametrize("path", REFUSED, ids=lambda p: p.stem)
    def test_each_refused_example_gives_its_code(self, path: Path) -> None:
        """Each example under examples/refused/ is refused with exactly the code it names."""
        admission = admit_pipeline(load_spec(path), CPU)
        codes = {r.code for r in admission.refusals()}
        assert codes == {expected_code(path)}
        assert all(r.hint for r in admission.refusals())

    def test_refused_examples_cover_every_admission_code(self) -> None:
        """Every code admission can raise from a spec has an example that teaches it."""
        runtime_only = {"attention.no_backend", "attention.plan_diverged", "residency.in_use"}
        assert {expected_code(p) for p in REFUSED} == set(REFUSAL_CODES) - runtime_only


class TestPlan:
    def test_reference_plan(self) -> None:
        """The reference pipeline's plan says which backend each site runs, and why."""
        plan = Orchestrator(load_spec(ROOT / "examples" / "tiny_t2i.toml"), platform=CPU).admit()
        vae = plan.components["vae"]
        assert (vae.loader, [(s.site, s.backend, s.reason) for s in vae.attention]) == (
            "custom",
            [("mid", "torch_sdpa", None)],
        )
        sites = {s.site: s for s in plan.components["transformer"].attention}
        # torch_sdpa, the CPU default, has no varlen kernel: the packed DiT falls back
        assert sites["self"].backend == "torch_flash"
        assert sites["self"].reason == "platform default fallback"
        assert sites["self"].provenance is Provenance.DEFAULT
        assert sites["cross"].backend == "torch_sdpa"
        assert sites["cross"].reason is None

    def test_explicit_global_backend_falls_back_where_allowed(self) -> None:
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
        plan = Orchestrator(spec, platform=CPU).admit()
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

    def test_all_shadowed_by_role_keys_is_not_consumed(self) -> None:
        """An ``all`` backend that role keys replace for every role the VAE builds is refused."""
        spec = decode_spec(
            'name = "p"\n[components.vae]\nkind = "tiny_vae"\n'
            'attention_backend = { all = "torch_sdpa", self = "torch_flash" }\n'
        )
        (refusal,) = admit_pipeline(spec, CPU).refusals()
        assert refusal.code == "attention.backend_not_consumed"
        assert "the role keys replace 'all'" in refusal.message

    def test_options_of_a_backend_nobody_runs_are_refused(self) -> None:
        """Backend options that no planned site would use are not dropped in silence."""
        spec = decode_spec(
            'name = "p"\n[attention.backend_options.sliding_window]\nwindow = 64\n'
            '[components.vae]\nkind = "tiny_vae"\n'
        )
        (refusal,) = admit_pipeline(spec, CPU).refusals()
        assert refusal.code == "attention.backend_not_consumed"
        assert "[attention.backend_options.sliding_window]" in refusal.message

    def test_options_of_a_planned_backend_pass(self) -> None:
        """Options for the backend a site will run are admitted."""
        spec = decode_spec(
            'name = "p"\n[attention.backend_options.sliding_window]\nwindow = 64\n'
            '[components.transformer]\nkind = "tiny_dit"\n'
            'attention_backend = { self = "sliding_window" }\n'
            "options = { packed_sequences = false }\n"
        )
        assert admit_pipeline(spec, CPU).refusals() == ()

    def test_missing_weights_file_is_refused(self, tmp_path: Path) -> None:
        """A weights file that does not exist is a loader refusal, also under a budget."""
        missing = tmp_path / "absent.safetensors"
        spec = decode_spec(
            f'name = "p"\nmemory.device_budget = "1GiB"\n[components.vae]\nkind = "tiny_vae"\n'
            f'options = {{ weights = "{missing}" }}\n'
        )
        (refusal,) = admit_pipeline(spec, CPU).refusals()
        assert refusal.code == "loader.unavailable"
        assert f"its weights file '{missing}' does not exist" in refusal.message

    def test_no_backend_when_every_candidate_is_unavailable(self) -> None:
        """With every backend the VAE supports banned, admission says none is left."""
        platform = Platform("cpu", unavailable={"torch_sdpa": "banned", "torch_flash": "banned"})
        spec = decode_spec('name = "p"\n[components.vae]\nkind = "tiny_vae"\n')
        admission = admit_pipeline(spec, platform)
        assert [r.code for r in admission.refusals()] == ["attention.no_backend"]


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

    def test_every_reason_of_every_component_at_once(self) -> None:
        """One admission reports the layout, the native path and the VAE's two problems."""
        orchestrator = Orchestrator(decode_spec(self.SPEC), platform=CPU)
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

    def test_check_json_reports_them(self) -> None:
        """``lifecycle check --json`` prints the contract's object with every refusal, exit 1."""
        path = ROOT / "examples" / "refused" / "unsupported_backend.toml"
        result = subprocess.run(
            [sys.executable, "-m", "lifecycle", "check", "--json", str(path)],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert result.returncode == 1
        report = json.loads(result.stdout)
        assert list(report) == ["pipeline", "admitted", "components", "refusals"]
        assert report["admitted"] is False
        assert report["components"]["vae"] == {
            "kind": "tiny_vae",
            "state": "configured",
            "loader": "custom",
            "residency": "resident",
            "attention": [],
        }
        (refusal,) = report["refusals"]
        assert list(refusal) == ["component", "trigger", "code", "message", "hint"]
        assert refusal["code"] == "attention.unsupported_backend"
        assert refusal["trigger"] == "admit"
        assert "supported: [torch_flash, torch_sdpa]" in refusal["message"]
