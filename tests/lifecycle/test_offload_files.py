"""Offload folders and files of an orchestrator: private, verified, contained, reclaimed, closed."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import msgspec
import pytest

from attention import Platform
from lifecycle.machines.tables import ComponentState, PipelineState
from lifecycle.offload_folder import OWNER_FILE, boot_id
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import TransitionFailed
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import PipelineSpec
from lifecycle.testing import capture_events, events_named
from tests.components.test_disk_offload import zero_in_place
from tests.lifecycle.conftest import ReferenceSpec
from tests.lifecycle.test_requests import generate
from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]


def named(spec: PipelineSpec, name: str) -> PipelineSpec:
    """Return ``spec`` under another pipeline name."""
    raw = msgspec.to_builtins(spec)
    raw["name"] = name
    return msgspec.convert(raw, PipelineSpec)


def folders(root: Path) -> list[Path]:
    """Return the orchestrator folders under an offload root."""
    return sorted(path for path in root.iterdir() if path.is_dir())


class TestFolders:
    def test_folder_is_private_and_files_read_only(
        self, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """The orchestrator's folder is 0700 and each written offload file 0400."""
        with Orchestrator(reference_spec("disk"), platform=cpu) as orch:
            orch.load()
            (folder,) = folders(tmp_path / "offload")
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700
            files = sorted(folder.glob("*.safetensors"))
            assert [file.name for file in files] == [
                "text_encoder.safetensors",
                "vae.safetensors",
            ]
            assert all(stat.S_IMODE(file.stat().st_mode) == 0o400 for file in files)
        assert folders(tmp_path / "offload") == []

    def test_host_target_never_touches_the_disk(
        self, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """With the host target no offload folder is created, through load and a request."""
        with Orchestrator(reference_spec("host"), platform=cpu) as orch:
            orch.load()
            generate(orch)
        assert not (tmp_path / "offload").exists()

    @pytest.mark.parametrize("name", ["../../x", "/absolute/x", "a/../../b", ".."])
    def test_pipeline_name_never_leaves_offload_dir(
        self, tmp_path: Path, name: str, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A pipeline name with separators or dots still puts its folder inside offload_dir."""
        root = tmp_path / "deep" / "offload"
        raw = msgspec.to_builtins(named(reference_spec("disk"), name))
        raw["memory"]["offload_dir"] = str(root)
        with Orchestrator(msgspec.convert(raw, PipelineSpec), platform=cpu) as orch:
            orch.load()
            written = sorted(tmp_path.rglob("*.safetensors"))
            assert len(written) == 2
            assert all(path.parent.parent == root for path in written)
            assert not (tmp_path / "x").exists()
            assert not Path("/absolute").exists()


class TestVerifiedOnload:
    def test_zeroed_file_fails_the_onload_and_keeps_the_state(
        self, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """An offload file zeroed in place fails the onload; the component stays offloaded."""
        with Orchestrator(reference_spec("disk"), platform=cpu) as orch:
            orch.load()
            (path,) = (tmp_path / "offload").glob("*/vae.safetensors")
            orch.onload("vae")
            weight = next(iter(orch.module("vae").parameters())).detach().clone()
            orch.offload("vae")
            zero_in_place(path, weight)
            with pytest.raises(TransitionFailed, match="differ from its checksum") as err:
                orch.onload("vae")
            assert err.value.component == "vae"
            assert orch.state("vae") is ComponentState.OFFLOADED

    def test_stat_verification_is_a_setting(self) -> None:
        """memory.verify_offload decodes to checksum by default and accepts stat."""
        base = 'name = "p"\n[components.a]\nkind = "tiny_vae"\n[[stages]]\nname = "s"\n'
        base += 'uses = ["a"]\n'
        assert decode_spec(base, "toml").memory.verify_offload == "checksum"
        spec = decode_spec(base + '[memory]\nverify_offload = "stat"\n', "toml")
        assert spec.memory.verify_offload == "stat"


KILLED_OWNER = """
import os, signal, sys
import msgspec
from attention import Platform
from lifecycle.spec import PipelineSpec
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec import load_spec

raw = msgspec.to_builtins(load_spec("examples/tiny_t2i.toml"))
raw["memory"].update(offload_target="disk", offload_dir=sys.argv[1] + "/offload")
orch = Orchestrator(msgspec.convert(raw, PipelineSpec), platform=Platform("cpu"))
orch.load()
print("loaded", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


class TestReclaim:
    def test_folder_of_a_killed_orchestrator_is_reclaimed(
        self, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """The next orchestrator on the same offload_dir deletes a SIGKILLed one's folder."""
        killed = run_python(KILLED_OWNER, tmp_path, cwd=ROOT, timeout=180)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        (left,) = folders(tmp_path / "offload")
        assert sorted(path.name for path in left.iterdir()) == [
            OWNER_FILE,
            "text_encoder.safetensors",
            "vae.safetensors",
        ]
        with (
            capture_events() as events,
            Orchestrator(reference_spec("disk"), platform=cpu) as orch,
        ):
            orch.load()
            assert left not in folders(tmp_path / "offload")
        assert [event["path"] for event in events_named(events, "residency.reclaimed")] == [
            str(left)
        ]

    def test_live_and_unknown_folders_are_kept(
        self, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A folder whose owner runs, and one without an owner file, are never reclaimed."""
        root = tmp_path / "offload"
        live, unknown, other_boot = root / "live", root / "unknown", root / "other-boot"
        for folder in (live, unknown, other_boot):
            folder.mkdir(parents=True)
        (live / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "boot_id": boot_id()}))
        (other_boot / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "boot_id": "0"}))
        with (
            capture_events() as events,
            Orchestrator(reference_spec("disk"), platform=cpu) as orch,
        ):
            orch.load()
        assert live.exists()
        assert unknown.exists()
        assert not other_boot.exists()
        assert [event["path"] for event in events_named(events, "residency.reclaimed")] == [
            str(other_boot)
        ]


def tamper(path: Path, how: str) -> None:
    """Do to the offload file at ``path`` what ``how`` says (a directory holds a file)."""
    if how in ("deleted", "a directory", "an unreadable directory"):
        path.unlink()
    if how in ("a directory", "an unreadable directory"):
        path.mkdir()
        (path / "keep").write_text("")
    if how in ("unreadable", "an unreadable directory"):
        path.chmod(0)


TAMPERED = ["deleted", "a directory", "unreadable", "an unreadable directory"]
"""What was done to offload files: release and close succeed whatever it was."""


class TestTamperedFiles:
    def test_refused_onload_then_release_and_close(
        self, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A directory in place of the file refuses the onload; release and close then succeed."""
        orch = Orchestrator(reference_spec("disk"), platform=cpu)
        orch.load()
        (folder,) = folders(tmp_path / "offload")
        tamper(folder / "vae.safetensors", "a directory")
        with pytest.raises(TransitionFailed, match="Is a directory"):
            orch.onload("vae")
        assert orch.state("vae") is ComponentState.OFFLOADED
        orch.release("vae")
        assert orch.state("vae") is ComponentState.RELEASED
        assert not (folder / "vae.safetensors").exists()
        orch.close()
        assert not folder.exists()

    @pytest.mark.parametrize("how", TAMPERED)
    def test_release_succeeds(
        self, how: str, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """Release drops the component and what is at its file's path, whatever was done to it."""
        with Orchestrator(reference_spec("disk"), platform=cpu) as orch:
            orch.load()
            (folder,) = folders(tmp_path / "offload")
            path = folder / "vae.safetensors"
            tamper(path, how)
            orch.release("vae")
            assert orch.state("vae") is ComponentState.RELEASED
            assert not os.path.lexists(path)
            assert (folder / "text_encoder.safetensors").exists()

    @pytest.mark.parametrize("how", TAMPERED)
    def test_close_succeeds(
        self, how: str, tmp_path: Path, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """Close releases every component and removes the folder, whatever was done to the files."""
        orch = Orchestrator(reference_spec("disk"), platform=cpu)
        orch.load()
        (folder,) = folders(tmp_path / "offload")
        for name in ("text_encoder", "vae"):
            tamper(folder / f"{name}.safetensors", how)
        orch.close()
        assert {orch.state(name) for name in orch.spec.components} == {ComponentState.RELEASED}
        assert orch.pipeline_state is PipelineState.RELEASED
        assert not folder.exists()


EMPTY_OFFLOAD_DIR = """name = "empty-dir"
[memory]
offload_target = "disk"
offload_dir = ""
[components.vae]
kind = "tiny_vae"
residency = "component_offload"
[[stages]]
name = "decode"
uses = ["vae"]
"""
EMPTY_MESSAGE = (
    "Expected a folder, got '', which would put the disk offload files in the working "
    "directory: name a folder, or leave the key out for .lifecycle/offload"
)


class TestEmptyOffloadDir:
    def test_python_api_raises_a_config_error(self, tmp_path: Path) -> None:
        """``offload_dir = ""`` is a ConfigError at its key from ``Orchestrator.from_file``."""
        spec = tmp_path / "spec.toml"
        spec.write_text(EMPTY_OFFLOAD_DIR)
        with pytest.raises(ConfigError) as err:
            Orchestrator.from_file(spec)
        assert (err.value.path, err.value.message) == ("$.memory.offload_dir", EMPTY_MESSAGE)

    @pytest.mark.parametrize("command", ["check", "run"])
    def test_cli_exits_two_and_writes_nothing(self, command: str, tmp_path: Path) -> None:
        """``lifecycle check|run`` in a process of its own exits 2 with one line naming the
        key, and leaves nothing in its working directory."""
        spec = tmp_path / "spec.toml"
        spec.write_text(EMPTY_OFFLOAD_DIR)
        result = run_python("lifecycle", command, spec, cwd=tmp_path, module=True)
        assert result.returncode == 2, result.stderr
        assert result.stdout == ""
        assert result.stderr == (
            f"lifecycle {command}: {spec}: {EMPTY_MESSAGE} - at `$.memory.offload_dir`\n"
        )
        assert sorted(path.name for path in tmp_path.iterdir()) == ["spec.toml"]


class TestPinned:
    @pytest.mark.parametrize(
        ("residency", "pinned"),
        [("resident", True), ("component_offload", False), ("layerwise_offload", False)],
    )
    def test_only_an_explicit_resident_is_pinned(self, residency: str, pinned: bool) -> None:
        """is_pinned holds for an explicit resident component only, not a default one."""
        text = f'name = "p"\n[components.a]\nkind = "tiny_vae"\nresidency = "{residency}"\n'
        text += '[components.b]\nkind = "tiny_vae"\n[[stages]]\nname = "s"\nuses = ["a", "b"]\n'
        spec = decode_spec(text, "toml")
        assert spec.components["a"].is_pinned is pinned
        assert spec.components["b"].is_pinned is False
