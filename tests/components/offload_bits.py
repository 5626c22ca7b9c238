"""Compare what a component computes resident and offloaded, run as a program of its own.

``python -m tests.components.offload_bits tiny SPEC OFFLOAD_DIR`` runs the tiny
pipeline of ``SPEC`` (its DiT six layers deep, as the issue found it) resident, then
with every component offloaded whole and layerwise, to the host and to disk, two
requests each. ``python -m tests.components.offload_bits folder FAMILY=FOLDER ...
OFFLOAD_DIR`` runs each folder's DiT on one request, then through the store of each
mode and target. Each prints one JSON line per case: ``{"case", "equal",
"max_abs"}``, both against the resident run.

Which GEMM kernels MKL runs is chosen when it first runs one, from
``MKL_ENABLE_INSTRUCTIONS`` among others: the test sets it, so this is a program. It
first prints ``{"premise": bool}``: whether a weight moved 8 bytes off a 64-byte
boundary changes a one-row product here. Where it does not (another BLAS, other
kernels), nothing below can show a misplaced weight.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import msgspec
import torch
from torch import nn

from attention import Platform
from components import ResidencyMode
from components.offload import StoreOptions, make_store
from components.residency import OffloadTarget
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec
from tests.components.dit_inputs import MIXED, group_of
from tests.components.test_dit_kinds import build, custom_outputs, loader_of
from tests.lifecycle.test_requests import generate

STORES: dict[str, tuple[ResidencyMode, OffloadTarget]] = {
    "component host": (ResidencyMode.COMPONENT_OFFLOAD, "host"),
    "component disk": (ResidencyMode.COMPONENT_OFFLOAD, "disk"),
    "layerwise host": (ResidencyMode.LAYERWISE_OFFLOAD, "host"),
    "layerwise disk": (ResidencyMode.LAYERWISE_OFFLOAD, "disk"),
}
"""Each offloaded case: the residency mode and the offload target."""


def misplaced_weight_changes_bits() -> bool:
    """Tell whether a one-row product changes when its weight lies 8 bytes off a boundary."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 32, generator=generator)
    row = torch.randn(1, 32, generator=generator)
    room = torch.empty(weight.numel() + 16)  # 64-byte aligned, as torch allocates
    moved = room[2 : 2 + weight.numel()].view_as(weight)  # 8 bytes past the boundary
    moved.copy_(weight)
    return not torch.equal(row @ weight.T, row @ moved.T)


def report(case: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Print whether ``got`` equals ``want`` bit for bit, and by how much it differs."""
    equal = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    max_abs = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    print(json.dumps({"case": case, "equal": equal, "max_abs": max_abs}), flush=True)


def tiny_spec(example: PipelineSpec, case: str, offload_dir: Path) -> PipelineSpec:
    """Return the tiny pipeline with a six-layer DiT, every component kept as ``case`` says.

    Layerwise streams the text encoder and the DiT; the VAE has no block stack and
    is offloaded whole.
    """
    raw = msgspec.to_builtins(example)
    raw["device"] = "cpu"
    mode, target = STORES.get(case, (ResidencyMode.RESIDENT, "host"))
    raw["memory"].update(offload_target=target, offload_dir=str(offload_dir))
    raw["components"]["transformer"].setdefault("options", {})["layers"] = 6
    for name, component in raw["components"].items():
        whole = name == "vae" and mode is ResidencyMode.LAYERWISE_OFFLOAD
        component["residency"] = (ResidencyMode.COMPONENT_OFFLOAD if whole else mode).value
    return msgspec.convert(raw, PipelineSpec)


def run_tiny(spec_path: Path, offload_dir: Path) -> None:
    """Report each offloaded case of the tiny pipeline against the resident one."""
    example = load_spec(spec_path)
    images: dict[str, list[torch.Tensor]] = {}
    for case in ("resident", *STORES):
        spec = tiny_spec(example, case, offload_dir)
        with Orchestrator(spec, platform=Platform("cpu")) as orchestrator:
            orchestrator.load()
            images[case] = [generate(orchestrator, seed) for seed in (0, 1)]
    for case in STORES:
        report(f"tiny-t2i {case}", images[case], images["resident"])


def run_folder_dit(family: str, folder: Path, offload_dir: Path) -> None:
    """Report the folder's DiT through each store against the DiT as the loader returns it."""
    loader = loader_of(folder, family)
    groups = [group_of(family, loader.config, MIXED[:1], 0)]  # one request: a one-row time MLP
    resident = custom_outputs(build(loader), groups)
    for case, (mode, target) in STORES.items():
        module: nn.Module = build(loader)
        options = StoreOptions(
            device=torch.device("cpu"),
            file=partial(Path, offload_dir / f"{family}-{case.replace(' ', '-')}.safetensors"),
            blocks=loader.blocks(module),
        )
        store = make_store(module, mode, target, options)
        try:
            store.onload()
            report(f"{family} {case}", custom_outputs(module, groups), resident)
        finally:
            store.close()


def main(argv: list[str]) -> None:
    """Run what ``argv`` asks for (see the module's docstring)."""
    torch.set_num_threads(1)
    premise = misplaced_weight_changes_bits()
    print(json.dumps({"premise": premise}), flush=True)
    if not premise:
        return
    what, *paths, offload_dir = argv
    if what == "tiny":
        run_tiny(Path(paths[0]), Path(offload_dir))
        return
    for pair in paths:
        family, folder = pair.split("=", 1)
        run_folder_dit(family, Path(folder), Path(offload_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
