"""The DiT comparisons of ``python -m benchmarks archs``: our DiTs against diffusers' classes.

Both load the same folder (seeded weights written by diffusers' ``save_pretrained``):
ours through the custom path (``flux_transformer``, ``pixart_transformer``,
``sd3_transformer``), diffusers' class through the native path. Each table times the
two in interleaved rounds (order reversed every round), at one intra-op thread and at
every CPU; times are medians over rounds, the ratio the median over rounds of ours /
diffusers' within a round.

- ``step_table``: one denoising step (one DiT forward, one request) in float32 and
  bfloat16. Flux-like blocks at width 1024 (8 heads of 128; one double-stream and one
  single-stream block; a 256 x 256 image, 256 tokens, and 256 text tokens) and a
  PixArt-like DiT at width 1024 (16 heads of 64, two blocks, 256 image tokens, T5 text
  padded to 120 tokens of which 24 are real), and an SD3-like MMDiT at width 1024 (16
  heads of 64, two joint blocks, 256 image tokens and 256 text tokens). Target: ratio
  <= 0.9.
- ``mixed_table``: four requests of four sizes (128 to 320 pixels a side) in one packed
  forward (ours) against one call per request (diffusers cannot batch mixed sizes).
  Throughput is requests per second; target: ours >= 1.5x.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from structlog.testing import capture_logs
from torch import nn

from attention import arm_layers
from benchmarks.attention_overhead import interleaved, threads
from components import registry
from components.kinds.dit_loader import DitLoader
from components.models.dit.flux import FluxInputs
from components.models.dit.pixart import PixArtInputs
from components.models.dit.sd3 import Sd3Inputs

ROUNDS = 5
DTYPES = (torch.float32, torch.bfloat16)
FLUX = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 128,
    "num_attention_heads": 8,
    "joint_attention_dim": 1024,
    "pooled_projection_dim": 256,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
PIXART = {
    "sample_size": 32,
    "num_layers": 2,
    "patch_size": 2,
    "attention_head_dim": 64,
    "num_attention_heads": 16,
    "caption_channels": 1024,
    "in_channels": 4,
    "out_channels": 8,
    "cross_attention_dim": 1024,
}
SD3 = {
    "sample_size": 32,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 64,
    "num_attention_heads": 16,
    "joint_attention_dim": 1024,
    "caption_projection_dim": 1024,
    "pooled_projection_dim": 256,
    "out_channels": 16,
    "pos_embed_max_size": 96,
}
KINDS = {"flux": "flux_transformer", "pixart": "pixart_transformer", "sd3": "sd3_transformer"}
STEP_SIDE = 256
"""The image side of a one-step request, in pixels (8 pixels a latent, 2 x 2 latents a token)."""
MIXED_SIDES = (128, 192, 256, 320)
TEXT_TOKENS = 256
PIXART_TEXT = (120, 24)
"""PixArt-alpha's padded T5 length, and the real tokens of the prompt."""


def write_dit(folder: Path, family: str) -> Path:
    """Write a seeded diffusers DiT of ``family`` (bench size) into ``folder/transformer``."""
    from diffusers import FluxTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    if family == "flux":
        model: Any = FluxTransformer2DModel(**FLUX)
    elif family == "sd3":
        model = SD3Transformer2DModel(**SD3)
    else:
        model = PixArtTransformer2DModel(**PIXART)
    model.save_pretrained(str(folder / "transformer"))
    return folder / "transformer"


def both(path: Path, family: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """Load ours (custom, armed) and diffusers' class (native) from one folder in ``dtype``."""
    loader = registry.get(KINDS[family]).from_options({"path": str(path)})
    assert isinstance(loader, DitLoader)
    loader.dtype = dtype
    with capture_logs():  # keep the selection events out of the printed table
        ours = loader.build("custom")
    arm_layers(ours)
    return ours, loader.build("native")


def request(family: str, side: int, dtype: torch.dtype, seed: int) -> Any:
    """Return one request of a ``side`` x ``side`` image, as diffusers' class takes it."""
    generator = torch.Generator().manual_seed(seed)
    latents = side // 8
    if family == "flux":
        grid = latents // 2
        ids = torch.zeros(grid * grid, 3)
        ids[:, 1] = torch.arange(grid * grid) // grid
        ids[:, 2] = torch.arange(grid * grid) % grid
        return FluxInputs(
            hidden_states=torch.randn(1, grid * grid, 64, generator=generator).to(dtype),
            encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 1024, generator=generator).to(dtype),
            pooled_projections=torch.randn(1, 256, generator=generator).to(dtype),
            timestep=torch.tensor([0.5]),
            img_ids=ids,
            txt_ids=torch.zeros(TEXT_TOKENS, 3),
            guidance=torch.tensor([3.5]),
        )
    if family == "sd3":
        return Sd3Inputs(
            hidden_states=torch.randn(1, 16, latents, latents, generator=generator).to(dtype),
            encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 1024, generator=generator).to(dtype),
            pooled_projections=torch.randn(1, 256, generator=generator).to(dtype),
            timestep=torch.tensor([500.0]),
        )
    padded, real = PIXART_TEXT
    mask = torch.zeros(1, padded, dtype=torch.int64)
    mask[0, :real] = 1
    return PixArtInputs(
        hidden_states=torch.randn(1, 4, latents, latents, generator=generator).to(dtype),
        encoder_hidden_states=torch.randn(1, padded, 1024, generator=generator).to(dtype),
        timestep=torch.tensor([500.0]),
        encoder_attention_mask=mask,
    )


def native_call(module: nn.Module, requests: list[Any]) -> Callable[[], object]:
    """Return a call of diffusers' class on each request, one after the other."""
    return lambda: [module(**r._asdict(), return_dict=False) for r in requests]


def timed(calls: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Return each call's seconds in each round, the calls interleaved (order reversed)."""
    with torch.inference_mode():
        return interleaved(calls, rounds=ROUNDS, inner=1)


def compare(
    ours: nn.Module, native: nn.Module, requests: list[Any], count: int
) -> dict[str, list[float]]:
    """Time ours on every request at once against diffusers' class request by request."""
    with threads(count):
        return timed({"ours": partial(ours, requests), "native": native_call(native, requests)})


def step_table(folders: dict[str, Path]) -> None:
    """Print one denoising step, ours against diffusers', per family, dtype and threads."""
    print("| DiT | dtype | threads | ours (s) | diffusers (s) | ours / diffusers |")
    print("|---|---|---|---|---|---|")
    for family, folder in folders.items():
        for dtype in DTYPES:
            ours, native = both(folder, family, dtype)
            one = [request(family, STEP_SIDE, dtype, seed=0)]
            for count in sorted({1, os.cpu_count() or 1}):
                t = compare(ours, native, one, count)
                ratio = statistics.median(
                    a / b for a, b in zip(t["ours"], t["native"], strict=True)
                )
                print(
                    f"| {family} | {str(dtype).removeprefix('torch.')} | {count} | "
                    f"{statistics.median(t['ours']):.3f} | {statistics.median(t['native']):.3f} | "
                    f"{ratio:.2f}x |",
                    flush=True,
                )


def mixed_table(folders: dict[str, Path]) -> None:
    """Print four requests of four sizes: one packed forward against four diffusers calls."""
    print(f"\nfour requests of {', '.join(f'{s}x{s}' for s in MIXED_SIDES)} pixels, float32\n")
    print("| DiT | threads | ours (req/s) | diffusers (req/s) | ours / diffusers |")
    print("|---|---|---|---|---|")
    for family, folder in folders.items():
        ours, native = both(folder, family, torch.float32)
        requests = [
            request(family, side, torch.float32, seed) for seed, side in enumerate(MIXED_SIDES)
        ]
        for count in sorted({1, os.cpu_count() or 1}):
            t = compare(ours, native, requests, count)
            speedup = statistics.median(b / a for a, b in zip(t["ours"], t["native"], strict=True))
            n = len(requests)
            print(
                f"| {family} | {count} | {n / statistics.median(t['ours']):.2f} | "
                f"{n / statistics.median(t['native']):.2f} | {speedup:.2f}x |",
                flush=True,
            )


def main() -> None:
    """Write the bench DiTs once and print both tables."""
    with tempfile.TemporaryDirectory() as root:
        folders = {family: write_dit(Path(root) / family, family) for family in KINDS}
        step_table(folders)
        mixed_table(folders)
