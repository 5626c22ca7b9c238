"""The spawn target of the layout parity tests: load a spec on one rank and run the DiT.

Each rank joins the process group through the environment torchrun would set, loads the
spec through ``Orchestrator.load()`` (which builds the mesh and splits the components),
runs the seeded example requests through the ``transformer`` and, on rank 0, saves what
it produced; a failure is written to ``rank<r>.error`` for the parent to report.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from attention import Platform, arm_layers, component_attention_scope
from attention.distributed import count_traffic
from components.kinds.tiny_dit import TinyDitLoader, TinyDitOptions, example_inputs
from components.mesh import ParallelMesh
from lifecycle import Orchestrator
from lifecycle.config import decode_spec

SEED = 20261130
REQUESTS = 4  # 6 + 11 + 16 + 6 = 39 tokens: 2 or 4 shards cut requests 2 (and 1) apart


def run_spec(spec_text: str, out: Path) -> list[torch.Tensor]:
    """Load ``spec_text`` here and return the DiT's predictions for the example requests."""
    spec = decode_spec(spec_text)
    options = TinyDitOptions(**spec.components["transformer"].options)
    inputs = example_inputs(options, REQUESTS, torch.Generator().manual_seed(SEED))
    with Orchestrator(spec) as orchestrator:
        orchestrator.load()
        with count_traffic() as traffic:
            predictions: list[torch.Tensor] = orchestrator.module("transformer")(*inputs)
    (out / f"traffic{dist.get_rank() if dist.is_initialized() else 0}.json").write_bytes(
        msgspec.json.encode(traffic.sent)
    )
    return predictions


def run_rank(
    rank: int, world: int, port: int, spec_text: str, out_dir: str, direct: bool = False
) -> None:
    """Run ``spec_text`` as rank ``rank`` of ``world``; rank 0 saves the predictions.

    ``direct`` builds the split DiT through its loader (``build_split``), not the lifecycle.
    """
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    out = Path(out_dir)
    try:
        predictions = build_split(spec_text, out) if direct else run_spec(spec_text, out)
        if rank == 0:
            torch.save(predictions, out / "predictions.pt")
    except Exception:  # reported to the parent, which asserts on it
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_split(spec_text: str, out: Path) -> list[torch.Tensor]:
    """Build the DiT split by the spec's layout through its loader, outside the lifecycle.

    For layouts whose ``DTensor`` weights the offload stores cannot hold yet (tensor
    parallel, FSDP): the mesh, the loader's split and the forward are the same ones
    ``Orchestrator.load()`` uses.
    """
    spec = decode_spec(spec_text)
    component = spec.components["transformer"]
    loader = TinyDitLoader.from_options(component.options)
    options = loader.options
    inputs = example_inputs(options, REQUESTS, torch.Generator().manual_seed(SEED))
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.parallel.timeout_s))
    mesh = ParallelMesh(spec.parallel, "cpu")
    loader.parallel = mesh.for_component(
        "transformer", sequence_parallel=True, tensor_parallel=True
    )
    with component_attention_scope(
        "transformer", ring=spec.parallel.ring_degree > 1, platform=Platform("cpu")
    ):
        module = loader.build("custom")
    arm_layers(module)
    with count_traffic() as traffic:
        predictions: list[torch.Tensor] = module(*inputs)
    (out / f"traffic{dist.get_rank()}.json").write_bytes(msgspec.json.encode(traffic.sent))
    return predictions
