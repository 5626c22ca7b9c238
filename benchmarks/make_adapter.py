"""Write a LoRA adapter file with seeded random matrices, in diffusers' (PEFT's) key layout.

``python -m benchmarks.make_adapter FOLDER OUT [--component transformer] [--rank 4]
[--alpha A] [--targets to_q,to_k,to_v,to_out.0] [--seed N]`` reads the linear weights
of ``FOLDER/COMPONENT`` from their safetensors headers (a pipeline folder written by
``benchmarks.make_pipeline``) and writes, for every 2-D ``<path>.weight`` whose module
path ends with one of ``--targets``, ``COMPONENT.<path>.lora_A.weight`` (``rank x in``)
and ``COMPONENT.<path>.lora_B.weight`` (``out x rank``), as diffusers'
``save_lora_weights`` does. With ``--alpha``, the file's ``lora_adapter_metadata``
says ``r``, ``lora_alpha`` and the target modules, as diffusers writes them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from components.weights import read_header

DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections diffusers' LoRA trainers target by default."""
SPREAD = 0.2
"""The standard deviation of every drawn entry: a visible change, far from overflow."""


def linear_shapes(
    folder: Path, component: str, targets: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """Return ``out x in`` of each linear weight of ``folder/component`` named by ``targets``."""
    shapes: dict[str, tuple[int, int]] = {}
    for file in sorted((folder / component).glob("*.safetensors")):
        for key, stored in read_header(file).items():
            path = key.removesuffix(".weight")
            if key.endswith(".weight") and len(stored.shape) == 2 and path.endswith(tuple(targets)):
                shapes[path] = (stored.shape[0], stored.shape[1])
    return shapes


def write_lora(
    shapes: Mapping[str, tuple[int, int]],
    out: Path,
    *,
    prefix: str | None,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
) -> Path:
    """Write a LoRA of ``rank`` for the linear layers ``shapes`` (``out x in``) into ``out``.

    Each matrix is drawn from ``seed`` and its key alone, so a file does not depend on
    the order of the layers. ``prefix`` (a component's name) starts every key, as in
    diffusers' pipeline layout; None writes a model's own module paths.
    """
    lead = "" if prefix is None else prefix + "."
    tensors = {}
    for path, (rows, cols) in sorted(shapes.items()):
        for ending, shape in (("lora_A.weight", (rank, cols)), ("lora_B.weight", (rows, rank))):
            key = f"{lead}{path}.{ending}"
            generator = torch.Generator().manual_seed(seed + sum(key.encode()) * 7919)
            tensors[key] = torch.randn(shape, generator=generator) * SPREAD
    metadata = {"format": "pt"}
    if alpha is not None:
        config = {"r": rank, "lora_alpha": alpha, "target_modules": sorted(shapes)}
        metadata["lora_adapter_metadata"] = json.dumps(
            {f"{lead}{key}": value for key, value in config.items()}, sort_keys=True
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and write the file."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.make_adapter",
        description="Write a LoRA file with seeded random matrices for a pipeline folder.",
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--component", default="transformer")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=None)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = linear_shapes(args.folder, args.component, args.targets.split(","))
    if not shapes:
        parser.error(f"no linear weight of {args.folder / args.component} ends in {args.targets}")
    out = write_lora(
        shapes, args.out, prefix=args.component, rank=args.rank, alpha=args.alpha, seed=args.seed
    )
    print(out)


if __name__ == "__main__":
    main()
