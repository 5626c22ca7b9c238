"""What each rank of the encoders' parallel tests runs (``run_rank``, spawned by
``tests.ranks.run_ranks``).

Each rank loads each spec through the lifecycle (which builds the mesh and splits T5's
heads and feed-forward units, or shards the weights with FSDP), runs what a pipeline
asks of every folder component, and writes the bytes of weights it holds; rank 0 also
saves the outputs. The specs run one after the other on one process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import msgspec
import torch
import torch.distributed as dist

from components import registry
from components.accounting import module_bytes
from components.folders.custom import CustomFolderLoader
from lifecycle import Orchestrator
from lifecycle.spec.reading import load_spec
from tests.components.encoder_outputs import outputs
from tests.ranks import joined


class Ran(NamedTuple):
    """What one rank made of one folder component: its outputs and the bytes it held."""

    outputs: list[torch.Tensor]
    held_bytes: int


def run_spec(spec_path: Path) -> dict[str, Ran]:
    """Load the spec; run every folder component with a custom path, by name."""
    spec = load_spec(spec_path)
    ran = {}
    with Orchestrator(spec) as pipeline:
        pipeline.load()
        for name, component in spec.components.items():
            loader = registry.get(component.kind).from_options(component.options)
            if not isinstance(loader, CustomFolderLoader):
                continue  # a tiny kind that only widens the layout's replica
            module = pipeline.module(name)
            with torch.inference_mode():
                found = outputs(loader, module)
            ran[name] = Ran(outputs=found, held_bytes=module_bytes(module))
    return ran


def main(out: Path, specs: list[Path]) -> None:
    """Run each spec on this rank; write what each component held, and rank 0's outputs."""
    torch.set_num_threads(1)
    for spec_path in specs:
        ran = run_spec(spec_path)
        rank = dist.get_rank()
        if rank == 0:
            torch.save({name: r.outputs for name, r in ran.items()}, out / f"{spec_path.stem}.pt")
        held = {name: r.held_bytes for name, r in ran.items()}
        (out / f"{spec_path.stem}.rank{rank}.json").write_bytes(msgspec.json.encode(held))


def run_rank(rank: int, world: int, init_file: str, out: str, specs: list[str]) -> None:
    """Join the gloo group as ``rank`` of ``world`` and run ``main`` on the specs."""
    with joined(rank, world, init_file):
        main(Path(out), [Path(spec) for spec in specs])
