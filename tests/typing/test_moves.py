"""Moves are typed: mypy refuses a misspelt or untyped move argument (issue 18)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = Path(__file__).with_name("moves_sample.py")

CONFIG = """\
[mypy]
strict = True
python_version = 3.11

# The sample's types are the project's own. mypy still reads every module the project
# imports (``lifecycle/__init__.py`` imports all of it), and the libraries below are
# thousands of files: following them made a cold check 40 CPU-s, not 4. Their names are
# ``Any`` here; stubs (numpy's) are skipped too.
[mypy-torch.*,transformers.*,diffusers.*,peft.*,huggingface_hub.*,numpy.*,safetensors.*,tokenizers.*,accelerate.*,rich.*,yaml.*]
follow_imports = skip
follow_imports_for_stubs = True
"""


@pytest.fixture
def mypy_cache(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """mypy's cache for this check, kept between runs in pytest's cache where it is on.

    Not the repository's (``make lint``): its options differ, and mypy would recheck
    every module of one after the other had run.
    """
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("mypy-moves") if cache is not None else tmp_path / "mypy"


def test_misspelt_move_arguments_fail_mypy(root: Path, tmp_path: Path, mypy_cache: Path) -> None:
    """mypy --strict reports every marked line of the sample with its message, and no other."""
    lines = SAMPLE.read_text().splitlines()
    expected = {
        number: found.group(1)
        for number, line in enumerate(lines, start=1)
        if (found := re.search(r"# E: (.+)$", line))
    }
    assert len(expected) == 7
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--config-file",
            str(config),
            "--cache-dir",
            str(mypy_cache),
            str(SAMPLE),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    reported: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        if (error := re.match(r".*moves_sample\.py:(\d+): error: (.+)$", line)) is not None:
            reported.setdefault(int(error.group(1)), []).append(error.group(2))
    # the project's own modules see the skipped libraries as Any and are reported too
    sample = [line for line in done.stdout.splitlines() if "moves_sample.py" in line]
    assert sorted(reported) == sorted(expected), "\n".join(sample) + done.stderr
    for number, text in expected.items():
        assert any(text in message for message in reported[number]), (number, reported[number])
