"""What a fresh ``lifecycle`` process does as it starts: it imports nothing heavy before
the command starts, a layout's sharding machinery only if it splits, and sets OpenMP's
wait policy before torch starts the runtime."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import lifecycle
from tests.processes import Finished, run_fresh_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_t2i.toml"

SHARDING = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.run")
"""What only a splitting layout (or ``--nproc``) needs; importing one costs ~0.03-1 CPU-s."""

# the CLI's entry module, then --version and --help, then every command's --help, then
# check, in one process; after each, whether it imported torch, and which sharding modules
COMMANDS = f"""
import sys
from lifecycle.cli.entry import main
codes = main(["--version"]), main(["--help"])
print("--version, --help:", *codes, "torch" in sys.modules)
from lifecycle.cli.main import _COMMANDS
codes = {{name: main([name, "--help"]) for name, _, _ in _COMMANDS}}
print("COMMAND --help:", *codes.items(), "torch" in sys.modules)
code = main(["check", sys.argv[1]])
print("check:", code, sorted(name for name in {SHARDING!r} if name in sys.modules))
"""


ENTRY = """
import sys
import lifecycle.cli.entry
print(sorted(name for name in ("torch", "components", "structlog") if name in sys.modules))
"""

# the entry point's start (``--version`` imports no torch), then the OpenMP runtime torch
# ships, started as torch's import would start it: what the runtime reads from the
# environment is all the test reads, and importing the rest of torch cost 1.5 CPU-s
STARTS_OPENMP = """
import ctypes
import importlib.util
import sys
from pathlib import Path

from lifecycle.cli.entry import main

code = main(["--version"])
(runtime,) = Path(importlib.util.find_spec("torch").origin).parent.glob("lib/libgomp*.so*")
ctypes.CDLL(str(runtime))
print(code, "torch" in sys.modules)
"""


def openmp_environment(policy: str | None) -> dict[str, str]:
    """Return this process's environment with ``OMP_WAIT_POLICY`` ``policy`` (None: unset),
    and GNU OpenMP asked to print what it runs with when it starts."""
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    return env


@pytest.fixture(scope="module")
def commands() -> Finished:
    """What ``COMMANDS`` left in a fresh interpreter, with OpenMP's wait policy unset."""
    # fresh: the fork server of tests/processes.py preloads torch and the sharding modules,
    # and this process's OpenMP started long ago
    result = run_fresh_python("-c", COMMANDS, EXAMPLE, cwd=ROOT, env=openmp_environment(None))
    assert result.returncode == 0, result.stderr
    return result


def said(result: Finished, head: str) -> str:
    """Return the rest of the line ``COMMANDS`` printed after ``head``."""
    (rest,) = [
        line.removeprefix(f"{head}: ")
        for line in result.stdout.splitlines()
        if line.startswith(f"{head}: ")
    ]
    return rest


class TestFreshProcess:
    def test_the_entry_point_imports_nothing_heavy(self) -> None:
        """The console script's module loads without torch or the house: it can catch SIGINT
        and set OpenMP's wait policy before they load."""
        result = run_fresh_python("-c", ENTRY, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "[]\n"

    def test_help_and_version_import_no_torch(self, commands: Finished) -> None:
        """``lifecycle --version`` and ``--help`` answer (exit 0) without importing torch."""
        assert said(commands, "--version, --help") == "0 0 False"

    def test_every_command_help_imports_no_torch(self, commands: Finished) -> None:
        """``lifecycle COMMAND --help`` answers (exit 0) for every command without importing
        torch: a command's options are read apart from what runs it."""
        assert said(commands, "COMMAND --help") == (
            "('check', 0) ('run', 0) ('diagram', 0) ('schema', 0) ('spec', 0) ('serve', 0) False"
        )

    def test_check_without_a_layout_imports_no_sharding(self, commands: Finished) -> None:
        """``lifecycle check`` of a one-process spec imports no FSDP, DTensor or torchrun."""
        assert said(commands, "check") == "0 []"

    def test_openmp_waits_passively_unless_told(self, commands: Finished) -> None:
        """The command has OpenMP sleep at once when it waits (GOMP_SPINCOUNT 0): the
        runtime, started by the command's own torch, says so."""
        assert "  GOMP_SPINCOUNT = '0'\n" in commands.stderr

    def test_openmp_keeps_a_wait_policy_it_was_told(self) -> None:
        """``OMP_WAIT_POLICY`` set in the environment stays the runtime's (ACTIVE: spin)."""
        env = openmp_environment("ACTIVE")
        result = run_fresh_python("-c", STARTS_OPENMP, cwd=ROOT, env=env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.endswith("\n0 False\n")
        assert "  GOMP_SPINCOUNT = '30000000000'\n" in result.stderr


class TestPackage:
    def test_every_export_resolves_to_its_home(self) -> None:
        """Each name of ``lifecycle.__all__`` loads on first use as the object its module
        defines, from the module the type checkers' imports name."""
        source = (ROOT / "lifecycle" / "__init__.py").read_text()
        (typing_block,) = [
            node
            for node in ast.parse(source).body
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        ]
        typed = {
            alias.name: node.module
            for node in typing_block.body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        assert typed == lifecycle._HOMES
        assert sorted(lifecycle.__all__) == sorted(typed)
        for name, home in typed.items():
            module = __import__(home, fromlist=[name])
            assert getattr(lifecycle, name) is getattr(module, name)
