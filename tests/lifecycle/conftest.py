"""Fixtures shared by the lifecycle tests: the reference pipeline and its orchestrator, and
pipelines of tiny VAEs under a memory budget."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import msgspec
import pytest

from attention import Platform
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec, load_spec
from lifecycle.spec.structs import PipelineSpec

ReferenceSpec: TypeAlias = Callable[..., PipelineSpec]
"""``reference_spec(target="host", **components)``: the reference spec with overrides."""

VaePipeline: TypeAlias = Callable[..., PipelineSpec]
"""``vae_pipeline(budget, stages, residency=None, wait_timeout=None)``: VAEs under a budget."""

VAE_BYTES = 248588
"""The bytes a tiny_vae with its default options takes on the device."""


def reference_maker(root: Path, folder: Path) -> ReferenceSpec:
    """Return the maker of the reference spec (examples/tiny_t2i.toml), offloading under
    ``folder``."""
    example = load_spec(root / "examples" / "tiny_t2i.toml")

    def make(target: str = "host", **components: dict[str, Any]) -> PipelineSpec:
        raw = msgspec.to_builtins(example)
        raw["memory"].update(offload_target=target, offload_dir=str(folder / "offload"))
        for name, changes in components.items():
            raw["components"][name].update(changes)
        return msgspec.convert(raw, PipelineSpec)

    return make


@pytest.fixture
def reference_spec(root: Path, tmp_path: Path) -> ReferenceSpec:
    """Make the reference spec (examples/tiny_t2i.toml), offloading under ``tmp_path``.

    Call it with an offload ``target`` and, per component name, a table of keys to
    override (``text_encoder={"residency": "resident"}``).
    """
    return reference_maker(root, tmp_path)


@pytest.fixture
def reference_orchestrator(reference_spec: ReferenceSpec, cpu: Platform) -> Iterator[Orchestrator]:
    """An orchestrator of the reference pipeline on the CPU platform, closed after the test.

    A test that checks what closing does closes it sooner with ``with reference_orchestrator
    as orch:``; closing twice is harmless.
    """
    with Orchestrator(reference_spec(), platform=cpu) as orchestrator:
        yield orchestrator


@pytest.fixture
def vae_pipeline() -> VaePipeline:
    """Make a pipeline of tiny VAEs under ``memory.device_budget``: the budget tests' pipeline.

    ``stages`` maps each stage, in order, to the components it uses. Every component is
    ``component_offload`` unless ``residency`` names it: with a mode, or with None for no
    residency key (resident by default). ``wait_timeout`` sets ``memory.wait_timeout``.
    """

    def make(
        budget: int,
        stages: Mapping[str, Sequence[str]],
        residency: Mapping[str, str | None] | None = None,
        wait_timeout: float | None = None,
    ) -> PipelineSpec:
        modes: dict[str, str | None] = {
            name: "component_offload" for uses in stages.values() for name in uses
        }
        modes.update(residency or {})
        memory: dict[str, float] = {"device_budget": budget}
        if wait_timeout is not None:
            memory["wait_timeout"] = wait_timeout
        raw = {
            "name": "vaes",
            "memory": memory,
            "components": {
                name: {"kind": "tiny_vae"} | ({} if mode is None else {"residency": mode})
                for name, mode in modes.items()
            },
            "stages": [{"name": name, "uses": list(uses)} for name, uses in stages.items()],
        }
        return decode_spec(msgspec.json.encode(raw).decode(), "json")

    return make


T2iPipeline: TypeAlias = Callable[..., PipelineSpec]
"""``t2i_pipeline(name, transformer_seed=2, **changes)``: a seeded text-to-image pipeline."""

DIT_BYTES = 170384
"""The bytes a tiny_dit with its default options takes on the device."""

ENCODER_BYTES = 138240
"""The bytes a tiny_text_encoder with its default options takes on the device."""


@pytest.fixture
def t2i_pipeline(tmp_path: Path) -> T2iPipeline:
    """Make a seeded text-to-image pipeline (encoder seed 1, VAE seed 3), host offload.

    The encoder and the VAE are ``component_offload``; the DiT (seed ``transformer_seed``)
    is resident by default, so a budget may evict it. ``components`` maps a component to
    a table of keys to override; ``memory`` and ``serving`` update those tables.
    """

    def make(
        name: str,
        transformer_seed: int = 2,
        *,
        memory: Mapping[str, Any] | None = None,
        serving: Mapping[str, Any] | None = None,
        **components: Mapping[str, Any],
    ) -> PipelineSpec:
        raw: dict[str, Any] = {
            "name": name,
            "device": "cpu",
            "memory": {"offload_target": "host", "offload_dir": str(tmp_path / "offload")},
            "serving": dict(serving or {}),
            "components": {
                "text_encoder": {
                    "kind": "tiny_text_encoder",
                    "residency": "component_offload",
                    "options": {"seed": 1},
                },
                "transformer": {"kind": "tiny_dit", "options": {"seed": transformer_seed}},
                "vae": {
                    "kind": "tiny_vae",
                    "residency": "component_offload",
                    "options": {"seed": 3},
                },
            },
            "stages": [
                {"name": "encode", "uses": ["text_encoder"]},
                {"name": "denoise", "uses": ["transformer"]},
                {"name": "decode", "uses": ["vae"]},
            ],
        }
        raw["memory"].update(memory or {})
        for component, changes in components.items():
            raw["components"][component].update(changes)
        return decode_spec(msgspec.json.encode(raw).decode(), "json")

    return make
