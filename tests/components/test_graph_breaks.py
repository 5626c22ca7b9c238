"""torch.compile traces a packed DiT forward as one graph: nothing in it reads a tensor's values."""

from __future__ import annotations

import torch

from tests.components.test_kinds import build_armed, inputs_for, loader_of, run


def test_packed_tiny_dit_forward_is_one_graph() -> None:
    """Dynamo traces the tiny DiT's whole forward over three packed requests of different
    sizes as one graph (``fullgraph``: a graph break raises), which computes the module's
    output: the packing's boundaries and each row's request come from host integers."""
    loader = loader_of("tiny_dit")
    module = build_armed(loader)
    inputs = inputs_for(loader, batch=3)
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, _: list[torch.Tensor]) -> object:
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(run(compiled, inputs), run(module, inputs))
    assert len(graphs) == 1
