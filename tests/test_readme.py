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


# Split so that this file does not name them itself.
_OUTSIDE = ("../" + "shared", "DESIGN" + ".md")
_CARRIED = ("README.md", "Makefile", "pyproject.toml", ".ci", "docs", "examples", "lifecycle")
_CARRIED += ("components", "attention", "benchmarks", "tests", "diagrams")


def test_the_repository_points_nowhere_outside_itself(root: Path) -> None:
    """No file the repository carries cites the team's own notes beside it, which clones lack."""
    files = [root / name for name in _CARRIED if (root / name).is_file()]
    files += [p for name in _CARRIED if (root / name).is_dir() for p in (root / name).rglob("*")]
    offending = [
        f"{path.relative_to(root)}: {needle}"
        for path in files
        if path.is_file() and path.suffix in {".py", ".md", ".toml", ".txt", ".yaml", ""}
        for needle in _OUTSIDE
        if needle in path.read_text(encoding="utf-8", errors="replace")
    ]
    assert offending == []


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_relative_links_resolve(root: Path, doc: str) -> None:
    """Every relative link and image in the docs names a file the repository carries."""
    path = root / doc
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8"))
    local = [t for t in targets if "://" not in t]
    assert local
    assert [t for t in local if not (path.parent / t).exists()] == []
