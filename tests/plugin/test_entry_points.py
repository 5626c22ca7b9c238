"""Out-of-tree kinds and backends reach a spec only from installed packages, by entry point.

The registries are built in this process over the test's distribution; one test runs
``python -m lifecycle`` to show that a module lying in the working directory is never
loaded as a plugin; ``run --nproc`` forks its workers from this process, registries and all.
"""

from __future__ import annotations

import json
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest

from attention import registry as backends
from attention.registry import BackendRegistry
from components import registry as kinds
from components.registry import KindRegistry
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec
from tests.conftest import Lifecycle
from tests.plugin.installed import dist_info
from tests.processes import run_python

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = """
[pipeline_lifecycle.kinds]
plugin_echo = tests.plugin.ext:EchoKind
plugin_factory = tests.plugin.ext:make_plain
plugin_rank_fault = tests.plugin.ext:RankFaultKind
plugin_rank_bug = tests.plugin.ext:RankBugKind
plugin_sequential_stack = tests.plugin.ext:SequentialStackKind
plugin_missing = tests.plugin.no_such_module:Kind
cwd_kind = cwd_plugin:make
misnamed = tests.plugin.ext:EchoKind
not_callable = tests.plugin.ext:SITE

[pipeline_lifecycle.backends]
plugin_sdpa = tests.plugin.ext:PluginBackend
torch_sdpa_clash = tests.plugin.ext:ClashingBackend
plugin_incomplete = tests.plugin.ext:IncompleteBackend
"""
SPEC = """
name = "plugged"
device = "cpu"

[components.echo]
kind = "plugin_echo"
attention_backend = "plugin_sdpa"

[components.plain]
kind = "plugin_factory"

[[stages]]
name = "all"
uses = ["echo", "plain"]
"""

FAULTY_REPLICAS = """
name = "faulty"
device = "cpu"

[parallel]
dp_size = 2
timeout_s = 30

[components.echo]
kind = "plugin_rank_fault"

[[stages]]
name = "all"
uses = ["echo"]
"""

LAYERWISE_SEQUENTIAL = """
name = "streamed"
device = "cpu"

[components.stack]
kind = "plugin_sequential_stack"
residency = "layerwise_offload"

[[stages]]
name = "all"
uses = ["stack"]
"""


@pytest.fixture
def plugin(tmp_path: Path) -> PathDistribution:
    """The plugin distribution: a ``*.dist-info`` folder in ``tmp_path/site``, installed nowhere."""
    return dist_info(tmp_path / "site", "lifecycle-test-plugin", ENTRY_POINTS)


@pytest.fixture
def plugin_registries(plugin: PathDistribution, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answer kind and backend questions in this process from the plugin distribution alone."""
    monkeypatch.setattr(kinds, "default_registry", KindRegistry([plugin]))
    monkeypatch.setattr(backends, "default_registry", BackendRegistry([plugin]))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working directory holding ``spec.toml`` and ``cwd_plugin.py``, which an entry point
    names: a module that must never be imported from there."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "cwd_plugin.py").write_text("raise SystemExit('imported from the working directory')\n")
    (work / "spec.toml").write_text(SPEC)
    return work


@pytest.mark.usefixtures("plugin_registries")
class TestEntryPoints:
    def test_installed_kinds_and_backend_are_admitted(
        self, lifecycle: Lifecycle, work: Path
    ) -> None:
        """A plugin kind with a plugin backend, and a factory kind, are admitted by name."""
        result = lifecycle("check", "--json", work / "spec.toml")
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        echo = report["components"]["echo"]
        assert echo["kind"] == "plugin_echo"
        assert [(s["site"], s["backend"]) for s in echo["attention"]] == [("self", "plugin_sdpa")]
        assert report["components"]["plain"]["kind"] == "plugin_factory"

    def test_installed_kinds_run(self, lifecycle: Lifecycle, work: Path) -> None:
        """The plugin pipeline loads both kinds and runs a request through the one that runs."""
        spec = work / "run.toml"
        spec.write_text(SPEC.replace('uses = ["echo", "plain"]', 'uses = ["echo"]'))
        result = lifecycle("run", spec, "--requests", "1", "--steps", "1")
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr

    def test_unknown_kind_lists_the_installed_ones(self) -> None:
        """An unknown kind is bad input at its key, listing built-in and installed kinds."""
        with pytest.raises(ConfigError) as err:
            decode_spec(SPEC.replace('kind = "plugin_factory"', 'kind = "evilmod:go"'))
        assert err.value.path == "$.components.plain.kind"
        message = err.value.message
        assert message.startswith(
            "Expected an installed component kind (tiny_text_encoder, tiny_dit, tiny_vae, "
            "tiny_upsampler, minilm_text_encoder, t5_encoder, clip_text_encoder, "
            "pixart_transformer, flux_transformer, sd3_transformer, autoencoder_kl, "
            "llm_text_encoder, qwen_image_transformer, autoencoder_kl_qwen_image, "
            "z_image_transformer, flux2_transformer, autoencoder_kl_flux2, umt5_encoder, "
            "clip_vision_encoder, wan_transformer, autoencoder_kl_wan, plugin_echo, "
            "plugin_factory, plugin_rank_fault, plugin_rank_bug, plugin_sequential_stack), "
            "got 'evilmod:go'; "
            "entry point 'plugin_missing' failed to load "
            "(ModuleNotFoundError: No module named 'tests.plugin.no_such_module')"
        )
        assert "whose kind is 'plugin_echo'; name the entry point after the kind" in message
        assert "entry point 'not_callable' failed to load (TypeError" in message
        assert message.endswith(
            "a package adds kinds through the entry-point group 'pipeline_lifecycle.kinds'"
        )

    def test_the_working_directory_is_not_importable(
        self, work: Path, plugin: PathDistribution
    ) -> None:
        """An entry point naming a module that lies only in the cwd fails to load; it never runs.

        ``python -m`` puts the working directory first on the path: a process of its own
        shows that ``lifecycle`` takes it off before any plugin loads.
        """
        spec = work / "cwd.toml"
        spec.write_text(SPEC.replace('kind = "plugin_factory"', 'kind = "cwd_kind"'))
        installed = [Path(plugin.locate_file("")), ROOT]  # the plugin's site, tests.plugin.ext
        result = run_python(
            "lifecycle", "check", "--json", spec, cwd=work, module=True, path=installed
        )
        assert result.returncode == 2, result.stderr
        assert "imported from the working directory" not in result.stdout + result.stderr
        error = json.loads(result.stdout)["error"]
        assert "entry point 'cwd_kind' failed to load (ModuleNotFoundError" in error["message"]

    def test_backend_rules_hold_for_installed_backends(
        self, lifecycle: Lifecycle, work: Path
    ) -> None:
        """Installed backends follow the registry's rules: listed after the built-ins, never
        under a built-in's name, never without a kernel (each failure logged, the rest kept)."""
        spec = work / "bad_backend.toml"
        spec.write_text(SPEC.replace('"plugin_sdpa"', '"plugin_flash"'))
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 2
        error = json.loads(result.stdout)["error"]
        assert error["path"] == "$.components.echo.attention_backend"
        assert (
            "torch_sdpa, torch_flash, reference, sliding_window, flash_attn, plugin_sdpa)"
            in (error["message"])
        )
        assert "attention.backend_load_failed" in result.stderr
        assert "name 'torch_sdpa' is taken by attention.backends" in result.stderr
        assert "NoForwardImpl must implement forward" in result.stderr
        assert "plugin_incomplete" not in error["message"]

    def test_layerwise_kind_without_a_module_list_is_refused(
        self, lifecycle: Lifecycle, work: Path
    ) -> None:
        """check refuses layerwise offload of an installed kind whose stack is no ModuleList."""
        spec = work / "streamed.toml"
        spec.write_text(LAYERWISE_SEQUENTIAL)
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 1, result.stdout + result.stderr
        (refusal,) = json.loads(result.stdout)["refusals"]
        assert refusal["code"] == "residency.not_offloadable"
        assert refusal["component"] == "stack"
        assert (
            "kind 'plugin_sequential_stack' builds its block stack 'blocks' as a Sequential, "
            "not an nn.ModuleList" in refusal["message"]
        )

    def test_a_rank_that_raises_ends_the_run(
        self, lifecycle_fd: Lifecycle, work: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A rank whose request raises exits 3; torchrun stops the other; both are named.

        The workers are forks of this process: they answer from its registries.
        """
        monkeypatch.chdir(work)
        spec = work / "faulty.toml"
        spec.write_text(FAULTY_REPLICAS)
        result = lifecycle_fd("run", spec, "--nproc", "2", "--requests", "100000")
        assert result.returncode == 3, result.stderr[-3000:]
        assert "RuntimeError: the device of rank 1 went away" in result.stderr
        assert "lifecycle run: rank 1 failed: exit code 3" in result.stderr
        assert "Traceback" not in result.stderr
        assert not list(work.glob(".lifecycle/offload/*"))

    @pytest.mark.parametrize("logs", ["console", "json"])
    def test_a_rank_with_a_bug_fails_in_one_line(
        self, lifecycle_fd: Lifecycle, work: Path, monkeypatch: pytest.MonkeyPatch, logs: str
    ) -> None:
        """An exception no run catches is exit 3 (not 1, refused): one line names the rank and
        the cause; its traceback is only in the JSON logs (``run.crashed``)."""
        monkeypatch.chdir(work)
        spec = work / "faulty.toml"
        spec.write_text(FAULTY_REPLICAS.replace("plugin_rank_fault", "plugin_rank_bug"))
        result = lifecycle_fd(
            "--log-format", logs, "run", spec, "--nproc", "2", "--requests", "100000"
        )
        assert result.returncode == 3, result.stderr[-3000:]
        lines = result.stderr.splitlines()
        text = [line for line in lines if not line.startswith("{")]
        assert [line for line in text if "a bug of rank 1" in line] == [
            "lifecycle run: rank 1 failed: exit code 3: ValueError: a bug of rank 1"
        ], result.stderr[-3000:]
        for said in ("Traceback", "py_callstack", "To enable traceback"):
            assert not any(said in line for line in text), result.stderr[-3000:]
        crashed = [json.loads(line) for line in lines if '"event":"run.crashed"' in line]
        if logs == "json":
            (event,) = crashed
            assert (event["rank"], event["cause"]) == (1, "ValueError: a bug of rank 1")
            assert event["exception"][0]["exc_type"] == "ValueError"
        else:
            assert crashed == []
        assert not list(work.glob(".lifecycle/offload/*"))
