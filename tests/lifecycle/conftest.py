"""Fixtures shared by the lifecycle tests: the reference pipeline and its orchestrator."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import msgspec
import pytest

from attention import Platform
from lifecycle.config import PipelineSpec, load_spec
from lifecycle.orchestrator import Orchestrator

ReferenceSpec: TypeAlias = Callable[..., PipelineSpec]
"""``reference_spec(target="host", **components)``: the reference spec with overrides."""


@pytest.fixture
def reference_spec(root: Path, tmp_path: Path) -> ReferenceSpec:
    """Make the reference spec (examples/tiny_t2i.toml), offloading under ``tmp_path``.

    Call it with an offload ``target`` and, per component name, a table of keys to
    override (``text_encoder={"residency": "resident"}``).
    """
    example = load_spec(root / "examples" / "tiny_t2i.toml")

    def make(target: str = "host", **components: dict[str, Any]) -> PipelineSpec:
        raw = msgspec.to_builtins(example)
        raw["memory"].update(offload_target=target, offload_dir=str(tmp_path / "offload"))
        for name, changes in components.items():
            raw["components"][name].update(changes)
        return msgspec.convert(raw, PipelineSpec)

    return make


@pytest.fixture
def reference_orchestrator(reference_spec: ReferenceSpec, cpu: Platform) -> Iterator[Orchestrator]:
    """An orchestrator of the reference pipeline on the CPU platform, closed after the test.

    A test that checks what closing does closes it sooner with ``with reference_orchestrator
    as orch:``; closing twice is harmless.
    """
    with Orchestrator(reference_spec(), platform=cpu) as orchestrator:
        yield orchestrator
