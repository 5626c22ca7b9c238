"""``lifecycle`` stopped by SIGINT or SIGTERM, in a process of its own: while ``run`` runs,
and while any command starts."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.processes import run_fresh_python, run_python, start_python

ROOT = Path(__file__).resolve().parents[2]

SPEC = """
name = "signalled"
device = "cpu"

[memory]
offload_target = "disk"
offload_dir = "{offload_dir}"

[components.text_encoder]
kind = "tiny_text_encoder"
residency = "component_offload"

[components.transformer]
kind = "tiny_dit"

[components.vae]
kind = "tiny_vae"
residency = "component_offload"

[[stages]]
name = "encode"
uses = ["text_encoder"]

[[stages]]
name = "denoise"
uses = ["transformer"]

[[stages]]
name = "decode"
uses = ["vae"]
"""


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"]
)
def test_signal_stops_cleanly(tmp_path: Path, signum: signal.Signals, code: int) -> None:
    """The request in flight finishes, the files go, the summary prints, exit 128 + signal."""
    offload_dir = tmp_path / "offload"
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(offload_dir=offload_dir))
    with start_python(
        "lifecycle", "run", spec, "--requests", "1000000", "--steps", "1", "--threads", "1",
        cwd=ROOT, module=True,
    ) as program:  # fmt: skip
        # A request's progress line, not the folder: admission's probe and load make and
        # fill the offload folder before any request runs.
        program.wait_for_line("lifecycle run: request r1 (1/1000000): done in", timeout=90)
        assert any(offload_dir.glob("*/*.safetensors"))
        program.send_signal(signum)
        returncode, stdout, stderr = program.wait(timeout=60)
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    assert f"{signum.name} received: finishing the request in flight" in stderr
    assert stdout.startswith("pipeline 'signalled': ")
    assert f"; stopped by {signum.name}\n" in stdout
    assert list(offload_dir.rglob("*")) == []


STARTING = """
import os, signal, sys
from importlib.metadata import entry_points

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's python has it
way, at, *argv = sys.argv[1:]


def interrupt():
    os.kill(os.getpid(), signal.SIGINT)


class Importing:  # SIGINT as the module `at` is first imported
    def find_spec(self, name, path=None, target=None):
        if name == at:
            sys.meta_path.remove(self)
            interrupt()


def opening(event, args):  # SIGINT as the file `at` is first opened
    global at
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and os.fspath(args[0]) == at:
        at = None
        interrupt()


if way == "import":
    sys.meta_path.insert(0, Importing())
else:
    sys.addaudithook(opening)
# what the installed `lifecycle` script does
sys.argv = ["lifecycle", *argv]
sys.exit(entry_points(group="console_scripts")["lifecycle"].load()())
"""
"""``python -c STARTING import|open MODULE|FILE COMMAND...``: the ``lifecycle`` console script,
sent SIGINT by itself at one moment of its start: as a module is first imported, or as a
file is first opened (an audit hook)."""


def command_line(command: str, spec: Path) -> tuple[str, ...]:
    """Return the arguments of ``command`` on ``spec``, as a user would type them."""
    if command == "run":
        return ("run", str(spec), "--requests", "50", "--threads", "1")
    if command == "serve":
        return ("serve", str(spec), "--port", "0", "--threads", "1")
    return ("check", str(spec))


def assert_stopped_cleanly(returncode: int, stderr: str) -> None:
    """Exit 130 and one line saying so: no traceback."""
    assert returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.endswith("lifecycle: stopped by SIGINT\n"), stderr


class TestInterruptedWhileStarting:
    @pytest.mark.parametrize("command", ["run", "check", "serve"])
    def test_before_torch_is_imported(self, command: str) -> None:
        """SIGINT as the command first imports torch: exit 130, no traceback."""
        # a fresh interpreter, the one place torch is not imported yet
        spec = ROOT / "examples" / "tiny_t2i.toml"
        argv = ["import", "torch", *command_line(command, spec)]
        result = run_fresh_python("-c", STARTING, *argv, cwd=ROOT)
        assert_stopped_cleanly(result.returncode, result.stderr)

    @pytest.mark.parametrize(
        ("command", "way"),
        [("run", "import"), ("run", "open"), ("check", "open"), ("serve", "open")],
        ids=["run-importing-the-house", "run-reading-the-spec", "check-reading", "serve-reading"],
    )
    def test_after_torch(self, tmp_path: Path, command: str, way: str) -> None:
        """SIGINT while the house is imported, or as the spec is read (before ``run`` or
        ``serve`` catch signals of their own): exit 130, no traceback."""
        spec = tmp_path / "spec.toml"
        spec.write_text(SPEC.format(offload_dir=tmp_path / "offload"))
        at = "lifecycle.orchestrator" if way == "import" else str(spec)
        result = run_python(STARTING, way, at, *command_line(command, spec), cwd=ROOT)
        assert_stopped_cleanly(result.returncode, result.stderr)
