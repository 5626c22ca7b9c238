"""Specs over a pipeline folder in each residency mode, and what diffusers makes of a request."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

import torch

from attention import Platform
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec
from tests.components.folder_runs import Request

Mode = Literal["resident", "host", "disk", "layerwise", "budget"]
MODES: tuple[Mode, ...] = get_args(Mode)

REQUESTS = {
    # PixArt's tiny DiT has sample_size 32: diffusers bins the size it asks for
    "pixart": Request(negative_prompt="blurry, dark", size=(64, 96), guidance_scale=4.5),
    "pixart-sigma": Request(size=(48, 48), steps=3, seed=3),
    "flux": Request(size=(32, 48), guidance_scale=3.5, seed=1),
    "sd3": Request(negative_prompt="a grey dog", size=(32, 64), steps=3, seed=2),
    "qwen-image": Request(negative_prompt="a grey dog", guidance_scale=3.0, size=(32, 48), seed=4),
    "z-image": Request(negative_prompt="blurry, dark", size=(64, 32), seed=5),
    "flux2-klein": Request(guidance_scale=3.0, size=(48, 32), seed=6),
    "flux2-klein-distilled": Request(guidance_scale=1.0, size=(32, 32), seed=7),
}
"""One request per pipeline class: each one's prompt, negative prompt, seed, steps, size."""


def mode_spec(folder: Path, mode: Mode, into: Path, cpu: Platform) -> Path:
    """Write a spec over ``folder`` that keeps its components as ``mode`` says; return it.

    ``host`` and ``disk`` offload every component whole; ``layerwise`` streams the block
    stack of every component that has one (the VAE has none: it is offloaded whole);
    ``budget`` sets ``memory.device_budget`` to the largest stage, so that every stage
    evicts what the one before it left.
    """
    lines = [f'source = "{folder}"', f'name = "{folder.name}-{mode}"', 'device = "cpu"']
    lines += [f'[memory]\noffload_target = "{"disk" if mode == "disk" else "host"}"']
    lines += [f'offload_dir = "{into / "offload"}"']
    spec = load_spec(folder)
    if mode == "budget":
        lines.append(f"device_budget = {largest_stage(spec, cpu)}")
    for name, component in spec.components.items():
        residency = {
            "resident": None,
            "budget": None,
            "host": "component_offload",
            "disk": "component_offload",
            "layerwise": "component_offload" if component.kind.startswith("autoencoder") else mode,
        }[mode]
        if residency == "layerwise":
            residency = "layerwise_offload"
        if residency is not None:
            lines.append(f'[components.{name}]\nresidency = "{residency}"')
    path = into / f"{mode}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def largest_stage(spec: PipelineSpec, cpu: Platform) -> int:
    """Return the bytes of the largest stage of ``spec``, as admission declares them (a
    stage with step windows holds one windowed use at a time)."""
    plan = Orchestrator(spec, platform=cpu).admit()
    sizes = {name: component.bytes or 0 for name, component in plan.components.items()}
    return max(
        sum(sizes[name] for name in held) for stage in spec.stages for held in stage.held_together()
    )


def run_arguments(request: Request) -> list[str]:
    """Return the ``lifecycle run`` options that ask for ``request`` (one image)."""
    height, width = request.size
    arguments = ["--prompt", request.prompt, "--seed", str(request.seed)]
    arguments += ["--size", f"{width}x{height}", "--steps", str(request.steps)]
    arguments += ["--guidance-scale", str(request.guidance_scale), "--threads", "1"]
    if request.negative_prompt is not None:
        arguments += ["--negative-prompt", request.negative_prompt]
    return arguments


def assert_same_pixels(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Assert two 8-bit images of float images within 1e-5 of each other are the same: a
    value that close to a rounding boundary may land one level over (our text encoders
    and VAE agree with the libraries' classes within 1e-5, not bit for bit), so at most
    one level apart, and at most 1% of the values apart at all."""
    assert ours.shape == theirs.shape
    apart = (ours.int() - theirs.int()).abs()
    assert apart.max() <= 1
    assert (apart > 0).float().mean() <= 0.01


def pixels(images: torch.Tensor) -> torch.Tensor:
    """Return images in [0, 1] ``(B, 3, H, W)`` as 8-bit pixels ``(B, H, W, 3)``, as
    diffusers' image processor quantises them."""
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
