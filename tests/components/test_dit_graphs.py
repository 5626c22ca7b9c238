"""What torch.compile's dynamo captures of the custom DiTs' blocks (``compile = "blocks"``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.components.dit_inputs import MIXED, group_of
from tests.components.test_dit_kinds import build, custom_outputs, loader_of
from tests.conftest import PipelineFolders


class Graphs:
    """A torch.compile backend that keeps each graph dynamo captures and runs it as traced."""

    def __init__(self) -> None:
        self.captured: list[torch.fx.GraphModule] = []

    def __call__(self, graph: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        self.captured.append(graph)
        return graph.forward

    def complex_results(self) -> list[str]:
        """Return the operations of the captured graphs whose result is complex."""
        found = []
        for graph in self.captured:
            for node in graph.graph.nodes:
                value = node.meta.get("example_value")
                if node.op != "placeholder" and getattr(value, "is_complex", bool)():
                    found.append(node.format_node())
        return found


@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_rotary_blocks_compute_no_complex_values(
    family: str, pipeline_folder: PipelineFolders
) -> None:
    """Compiled, a rotary DiT's blocks rotate q and k in real arithmetic, which inductor
    fuses, where eager multiplies complex numbers, which inductor would run outside its
    kernels: no captured operation yields a complex value, and the output equals eager's
    within 1e-5."""
    folder: Path = pipeline_folder(family)
    loader = loader_of(folder, family)
    module = build(loader)
    groups = [group_of(family, loader.config, [MIXED[0]], seed=0)]
    eager = custom_outputs(module, groups)
    graphs = Graphs()
    for stack in ("transformer_blocks", "single_transformer_blocks"):
        for block in getattr(module, stack, ()):
            block.compile(backend=graphs)
    compiled = custom_outputs(module, groups)
    assert graphs.captured
    assert graphs.complex_results() == []
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
