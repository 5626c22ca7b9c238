"""Moves are typed: mypy refuses a misspelt or untyped move argument (issue 18)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SAMPLE = Path(__file__).with_name("moves_sample.py")


def test_misspelt_move_arguments_fail_mypy(root: Path) -> None:
    """mypy --strict reports every marked line of the sample with its message, and no other."""
    lines = SAMPLE.read_text().splitlines()
    expected = {
        number: found.group(1)
        for number, line in enumerate(lines, start=1)
        if (found := re.search(r"# E: (.+)$", line))
    }
    assert len(expected) == 7
    # the repository's own cache (``make lint`` fills it): a cold run takes a minute
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(SAMPLE)],
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
    assert sorted(reported) == sorted(expected), done.stdout + done.stderr
    for number, text in expected.items():
        assert any(text in message for message in reported[number]), (number, reported[number])
