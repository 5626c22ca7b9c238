"""Compile and quantization as spec keys: decoded, shown by check, refused without backing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from attention import AttentionImpl, Platform, register_backend
from attention.backends.torch_sdpa import TorchSdpaBackend, TorchSdpaImpl
from attention.registry import unregister_backend
from lifecycle.admission import admit_pipeline
from lifecycle.refusals import RefusalCode
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec, load_spec
from tests.blocked_imports import blocking
from tests.conftest import Lifecycle
from tests.lifecycle.test_admission import CHECK_JSON, expected_code, needs_of
from tests.processes import run_python

DIT = """
name = "accelerated"
device = "cpu"

[components.transformer]
kind = "tiny_dit"
{keys}

[[stages]]
name = "denoise"
uses = ["transformer"]
"""


def write_spec(folder: Path, keys: str) -> Path:
    """Write the one-DiT spec with ``keys`` in its component table; return its path."""
    path = folder / "spec.toml"
    path.write_text(DIT.format(keys=keys))
    return path


class TestDecoding:
    @pytest.mark.parametrize(
        ("keys", "at", "expected"),
        [
            ('compile = "fast"', "compile", "Expected `blocks | off | whole`, got 'fast'"),
            (
                'quantization = "int4"',
                "quantization",
                "Expected `float8_weight_only | int8_dynamic | int8_weight_only | off`, got 'int4'",
            ),
        ],
    )
    def test_unknown_value_is_a_config_error_at_its_key(
        self, keys: str, at: str, expected: str
    ) -> None:
        """An unknown compile mode or quantization is bad input naming its key and the choices."""
        with pytest.raises(ConfigError) as err:
            decode_spec(DIT.format(keys=keys))
        assert err.value.path == f"$.components.transformer.{at}"
        assert err.value.message == expected

    def test_absent_keys_are_off(self) -> None:
        """A component that sets neither key is neither compiled nor quantized."""
        component = decode_spec(DIT.format(keys="")).components["transformer"]
        assert (component.compile_mode, component.quantization_mode) == ("off", "off")


class TestCheck:
    def test_check_shows_compile_quantization_and_quantized_bytes(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """check --json carries compile, quantization, and the bytes int8 weights hold; the
        table shows both."""
        plain = json.loads(lifecycle("check", "--json", write_spec(tmp_path, "")).stdout)
        spec = write_spec(tmp_path, 'compile = "blocks"\nquantization = "int8_dynamic"')
        found = json.loads(lifecycle("check", "--json", spec).stdout)
        component = found["components"]["transformer"]
        assert (component["compile"], component["quantization"]) == ("blocks", "int8_dynamic")
        assert plain["components"]["transformer"]["compile"] == "off"
        # each linear weight: 4 bytes an element in float32, 1 (and 5 a row) once int8
        assert component["bytes"] < plain["components"]["transformer"]["bytes"]
        shown = lifecycle("check", spec).stdout
        assert "compile" in shown
        assert "quantization" in shown
        assert "blocks   int8_dynamic" in shown


ACCELERATION_EXAMPLES = (
    "compiler_missing",
    "not_compilable",
    "missing_package",
    "quantized_component",
    "quantized_split",
)
"""The examples under examples/refused/ of the refusals compile and quantization bring."""


class TestRefusals:
    @pytest.mark.parametrize("name", ACCELERATION_EXAMPLES)
    def test_each_example_is_refused_by_check_json(
        self, root: Path, name: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """check --json of each compile and quantization example exits 1 with the one code
        its first line names and a fix, in a process under the example's variables and
        unable to import the packages it runs without."""
        path = root / "examples" / "refused" / f"{name}.toml"
        env, without = needs_of(path)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        done = run_python(blocking(*without) + CHECK_JSON, path, cwd=path.parent)
        assert done.returncode == 1, done.stderr
        refusals = json.loads(done.stdout)["refusals"]
        assert {r["code"] for r in refusals} == {expected_code(path)}
        assert all(r["hint"] for r in refusals)

    def test_no_compiler_is_refused_naming_cxx_and_the_package(
        self, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """check in a process whose PATH holds no compiler refuses a compiled component with
        acceleration.compiler_missing, naming CXX and g++; with CXX at no compiler too."""
        example = root / "examples" / "refused" / "compiler_missing.toml"
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(root / "no-compiler-here"))
        for cxx in (None, "/nonexistent/c++"):
            if cxx is not None:
                monkeypatch.setenv("CXX", cxx)
            done = run_python(CHECK_JSON, example, cwd=root)
            assert done.returncode == 1, done.stderr
            (refusal,) = json.loads(done.stdout)["refusals"]
            assert refusal["code"] == "acceleration.compiler_missing"
            assert "CXX" in refusal["message"]
            assert "g++ package" in refusal["hint"]
            assert (cxx or "'g++'") in refusal["message"]

    def test_whole_refuses_an_explicit_kernel_dynamo_cannot_trace(
        self, cpu: Platform, opaque_backend: str, tmp_path: Path
    ) -> None:
        """compile = "whole" with an explicit backend whose kernel cannot be traced is
        acceleration.not_compilable naming the backend; "blocks" admits it."""
        keys = f'attention_backend = {{ cross = "{opaque_backend}" }}\n'
        whole = admit_pipeline(load_spec(write_spec(tmp_path, keys + 'compile = "whole"')), cpu)
        (refusal,) = whole.refusals()
        assert refusal.code is RefusalCode.NOT_COMPILABLE
        assert f"'{opaque_backend}'" in refusal.message
        blocks = admit_pipeline(load_spec(write_spec(tmp_path, keys + 'compile = "blocks"')), cpu)
        assert blocks.refusals() == ()

    def test_fsdp_of_a_quantized_component_is_refused(self, cpu: Platform, tmp_path: Path) -> None:
        """FSDP of a quantized DiT is parallel.quantized_split, as tensor parallel is."""
        path = write_spec(tmp_path, 'quantization = "int8_dynamic"')
        text = path.read_text().replace(
            'device = "cpu"',
            'device = "cpu"\n[parallel]\ncfg_parallel = true\nfsdp = ["transformer"]',
        )
        admission = admit_pipeline(decode_spec(text), cpu)
        assert RefusalCode.QUANTIZED_SPLIT in {r.code for r in admission.refusals()}


class OpaqueImpl(TorchSdpaImpl):
    """SDPA, declared as a kernel dynamo cannot trace (as a C extension's would be)."""

    traceable = False


@pytest.fixture
def opaque_backend() -> Iterator[str]:
    """Register an untraceable backend for one test; unregister it after."""

    class OpaqueBackend(TorchSdpaBackend):
        name = "opaque_test"
        impl_cls: type[AttentionImpl] = OpaqueImpl
        is_automatic = False

    register_backend(OpaqueBackend)
    try:
        yield OpaqueBackend.name
    finally:
        unregister_backend(OpaqueBackend.name)
