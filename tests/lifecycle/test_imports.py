"""What a fresh ``lifecycle`` process imports: nothing heavy before the command starts, a
layout's sharding machinery only if it splits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lifecycle
from tests.processes import run_fresh_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_t2i.toml"

SHARDING = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.run")
"""What only a splitting layout (or ``--nproc``) needs; importing one costs ~0.03-1 CPU-s."""

# the CLI's entry module, then --version and --help, then check, in one process; after
# each, whether it imported torch, and which sharding modules
COMMANDS = f"""
import sys
from lifecycle.cli.entry import main
codes = main(["--version"]), main(["--help"])
print("--version, --help:", *codes, "torch" in sys.modules)
code = main(["check", sys.argv[1]])
print("check:", code, sorted(name for name in {SHARDING!r} if name in sys.modules))
"""


ENTRY = """
import sys
import lifecycle.cli.entry
print(sorted(name for name in ("torch", "components", "structlog") if name in sys.modules))
"""


@pytest.fixture(scope="module")
def commands() -> dict[str, str]:
    """What ``COMMANDS`` said after each command in a fresh interpreter, by command."""
    # fresh: the fork server of tests/processes.py preloads torch and the sharding modules
    result = run_fresh_python("-c", COMMANDS, EXAMPLE, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    said = [line.partition(": ") for line in result.stdout.splitlines()]
    return {head: rest for head, _, rest in said if head in ("--version, --help", "check")}


class TestFreshProcess:
    def test_the_entry_point_imports_nothing_heavy(self) -> None:
        """The console script's module loads without torch or the house: it can catch SIGINT
        and set OpenMP's wait policy before they load."""
        result = run_fresh_python("-c", ENTRY, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "[]\n"

    def test_help_and_version_import_no_torch(self, commands: dict[str, str]) -> None:
        """``lifecycle --version`` and ``--help`` answer (exit 0) without importing torch."""
        assert commands["--version, --help"] == "0 0 False"

    def test_check_without_a_layout_imports_no_sharding(self, commands: dict[str, str]) -> None:
        """``lifecycle check`` of a one-process spec imports no FSDP, DTensor or torchrun."""
        assert commands["check"] == "0 []"


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
