"""What each rank of the T5 tensor-parallel test runs under torchrun.

Usage: ``torchrun --nproc-per-node N t5_worker.py SPEC OUT``. Each rank loads the spec
through the lifecycle (which builds the ``tp`` mesh and splits T5's heads and
feed-forward units), encodes the fixed prompts, and writes the bytes of weights it
holds; rank 0 also saves the states.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from components import registry
from components.accounting import module_bytes
from components.kinds.t5_encoder import T5EncoderLoader
from lifecycle import Orchestrator
from lifecycle.config import load_spec

TEXTS = ["a red fox leaps over the snow at dawn", "ramen", ""]
LENGTH = 16


def encode(spec_path: Path) -> tuple[list[torch.Tensor], int]:
    """Load the spec, encode ``TEXTS`` masked and unmasked; return the states and held bytes."""
    spec = load_spec(spec_path)
    component = spec.components["text_encoder"]
    loader = registry.get(component.kind).from_options(component.options)
    assert isinstance(loader, T5EncoderLoader)
    with Orchestrator(spec) as pipeline:
        pipeline.load()
        module = pipeline.module("text_encoder")
        with torch.inference_mode():
            states = [
                loader.encode(module, TEXTS, LENGTH, masked=masked).hidden
                for masked in (True, False)
            ]
        return states, module_bytes(module)


def main(spec_path: Path, out: Path) -> None:
    """Encode on this rank; write what it holds, and rank 0's states."""
    torch.set_num_threads(1)
    states, held = encode(spec_path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        torch.save(states, out / "states.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"held_bytes": held}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
