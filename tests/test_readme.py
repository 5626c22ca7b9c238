"""The README's Python tour runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lifecycle import ComponentState, Orchestrator


def test_python_tour_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], root: Path
) -> None:
    """Every ```python block of the README executes from the repository root, logging to stderr."""
    blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.DOTALL)
    assert blocks
    monkeypatch.chdir(root)
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    pipeline = namespace["pipeline"]
    assert isinstance(pipeline, Orchestrator)
    assert pipeline.state("vae") is ComponentState.RELEASED
    stdout = capsys.readouterr().out
    assert "lifecycle.transition" not in stdout
    assert "SitePlan(site='self'" in stdout  # what the tour prints on purpose
