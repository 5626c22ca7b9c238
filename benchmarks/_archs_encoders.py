"""The encoder comparisons of ``python -m benchmarks archs``: our T5, CLIP and VAE against
the libraries' classes, on the same weights (issue 20).

Each comparison builds both sides from one folder the library itself wrote, as a ``Pair``
on a device and dtype: our custom path (``loader.build("custom")``, its default backends)
and the library's class from ``from_pretrained``, fed the same inputs. ``main`` times each
pair in float32 and in bfloat16 on the CPU at one intra-op thread and at all of them, side
by side in one run; ``make gpu-check`` times the same pairs on CUDA in bfloat16.

- ``t5``: T5 v1.1-style (gated GELU) 1024 wide, 8 layers, two PixArt prompts padded to
  120 tokens with the padding masked, against ``T5EncoderModel``;
- ``clip``: CLIP-L-style (quick GELU) 768 wide, 12 layers, two prompts padded to 77,
  hidden states asked for (as SD3 and Flux use them), against ``CLIPTextModel``;
- ``vae``: one decode, SD's layout at half width, a 16x16 latent to a 128x128 image,
  against diffusers' ``AutoencoderKL``.

Time: median of interleaved rounds. Target: ours <= 1.0x.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from structlog.testing import capture_logs
from torch import nn

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from benchmarks._progress import no_progress_bars
from benchmarks.attention_overhead import interleaved, threads
from components.folders.custom import CustomFolderLoader
from components.kinds.autoencoder_kl import AutoencoderKlLoader
from components.kinds.clip_text_encoder import ClipTextEncoderLoader
from components.kinds.t5_encoder import T5EncoderLoader
from components.libraries import is_importable

# B prompts, L tokens

ROUNDS = 9
BATCH = 2
T5_TOKENS, T5_REAL = 120, 30  # PixArt pads to 120; a prompt of about 30 tokens
CLIP_TOKENS = 77
VAE_CHANNELS = (64, 128, 256, 256)  # SD's VAE at half width
VAE_LATENT = 16  # a 128x128 image
DTYPES = (torch.float32, torch.bfloat16)


class Pair(NamedTuple):
    """Our path and the library's, built on one device and dtype, on the same inputs."""

    name: str
    ours: Callable[[], torch.Tensor]
    theirs: Callable[[], torch.Tensor]

    def error(self) -> float:
        """Return max|ours - theirs| / max|theirs| (in float32)."""
        mine, library = self.ours().float(), self.theirs().float()
        return float((mine - library).abs().max() / library.abs().max())


Build = Callable[[Path, torch.device, torch.dtype], Pair]
"""Write a library folder at the path, then build both sides on the device in the dtype."""


class Row(NamedTuple):
    """One comparison at one thread count."""

    name: str
    threads: int
    ours_ms: float
    theirs_ms: float
    error: float  # max|ours - theirs| / max|theirs|

    @property
    def ratio(self) -> float:
        """Our time over theirs."""
        return self.ours_ms / self.theirs_ms


def custom_module(
    loader: CustomFolderLoader, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    """Build ``loader``'s custom path in ``dtype`` with the device's default backends, armed,
    on ``device``; events swallowed."""
    loader.dtype = dtype
    with (
        capture_logs(),
        component_attention_scope(
            ComponentRequests(component="bench"),
            platform=Platform("cuda" if device.type == "cuda" else "cpu"),
        ),
    ):
        module = loader.build("custom").to(device)
    arm_layers(module)
    return module


def token_ids(vocab: int, length: int, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return seeded ids ``(B, L)`` whose first ``real`` tokens are real, and that mask."""
    ids = torch.randint(3, vocab, (BATCH, length), generator=torch.Generator().manual_seed(0))
    keep = (torch.arange(length) < real).to(torch.int64).expand(BATCH, -1)
    return ids * keep, keep


@no_progress_bars()
def t5(folder: Path, device: torch.device, dtype: torch.dtype) -> Pair:
    """T5 encoder, masked, as PixArt runs it: ours against ``T5EncoderModel``."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=32128, d_model=1024, d_kv=64, d_ff=2816, num_layers=8, num_heads=16,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    )  # fmt: skip
    T5EncoderModel(config).save_pretrained(str(folder))
    ours = custom_module(T5EncoderLoader.from_options({"path": str(folder)}), device, dtype)
    theirs = T5EncoderModel.from_pretrained(str(folder)).eval().to(device, dtype)
    ids, keep = (t.to(device) for t in token_ids(config.vocab_size, T5_TOKENS, T5_REAL))
    return Pair(
        "T5 encoder (1024 wide, 8 layers, 2 x 120 tokens, masked)",
        lambda: ours(ids, keep),
        lambda: theirs(ids, attention_mask=keep).last_hidden_state,
    )


@no_progress_bars()
def clip(folder: Path, device: torch.device, dtype: torch.dtype) -> Pair:
    """CLIP text model with hidden states, as SD3 runs it: ours against ``CLIPTextModel``."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=CLIP_TOKENS, hidden_act="quick_gelu",
        eos_token_id=2,
    )  # fmt: skip
    CLIPTextModel(config).save_pretrained(str(folder))
    ours = custom_module(ClipTextEncoderLoader.from_options({"path": str(folder)}), device, dtype)
    theirs = CLIPTextModel.from_pretrained(str(folder)).eval().to(device, dtype)
    ids = token_ids(config.vocab_size, CLIP_TOKENS, CLIP_TOKENS)[0].to(device)

    def library() -> torch.Tensor:
        out: Any = theirs(ids, output_hidden_states=True)
        return torch.cat([out.pooler_output[:, None], out.hidden_states[-2]], dim=1)

    def mine() -> torch.Tensor:
        states = ours(ids)
        return torch.cat([states.pooled[:, None], states.penultimate], dim=1)

    return Pair("CLIP text model (768 wide, 12 layers, 2 x 77 tokens)", mine, library)


@no_progress_bars()
def vae(folder: Path, device: torch.device, dtype: torch.dtype) -> Pair:
    """VAE decode, as every pipeline ends: ours against diffusers' ``AutoencoderKL``."""
    from diffusers import AutoencoderKL

    AutoencoderKL(
        block_out_channels=VAE_CHANNELS,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        layers_per_block=2,
        latent_channels=4,
    ).save_pretrained(str(folder))
    loader = AutoencoderKlLoader.from_options({"path": str(folder)})
    ours = custom_module(loader, device, dtype)
    theirs = AutoencoderKL.from_pretrained(str(folder)).eval().to(device, dtype)
    draw = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, VAE_LATENT, VAE_LATENT, generator=draw).to(device, dtype)
    image = VAE_LATENT * loader.scale_factor
    return Pair(
        f"VAE decode ({', '.join(map(str, VAE_CHANNELS))} channels, 1 x {image}x{image})",
        lambda: loader.decode(ours, latents),
        lambda: loader.decode(theirs, latents),
    )


ENCODERS: dict[str, Build] = {"t5": t5, "clip": clip, "vae": vae}


def timed(pair: Pair, counts: tuple[int, ...]) -> list[Row]:
    """Time ``pair`` at each thread count; compare its outputs once."""
    with torch.inference_mode():
        error = pair.error()
        rows = []
        for count in counts:
            with threads(count):
                calls: dict[str, Callable[[], object]] = {"ours": pair.ours, "theirs": pair.theirs}
                samples = interleaved(calls, rounds=ROUNDS, inner=1)
            ours_ms, theirs_ms = (1e3 * statistics.median(samples[k]) for k in calls)
            rows.append(Row(pair.name, count, ours_ms, theirs_ms, error))
    return rows


def main() -> None:
    """Print every encoder comparison on the CPU, float32 and bfloat16, at one thread and at
    all."""
    if not (is_importable("transformers") and is_importable("diffusers")):
        print(
            "skipped: the libraries are not installed (pip install 'pipeline-lifecycle[diffusers]')"
        )
        return
    counts = tuple(sorted({1, os.cpu_count() or 1}))
    cpu = torch.device("cpu")
    print("| comparison | dtype | threads | ours ms | theirs ms | ours / theirs | max rel. error |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for key, build in ENCODERS.items():
            for dtype in DTYPES:
                folder = Path(scratch) / f"{key}-{str(dtype).removeprefix('torch.')}"
                for row in timed(build(folder, cpu, dtype), counts):
                    print(
                        f"| {row.name} | {str(dtype).removeprefix('torch.')} | {row.threads} | "
                        f"{row.ours_ms:.1f} | {row.theirs_ms:.1f} | {row.ratio:.2f}x | "
                        f"{row.error:.1e} |",
                        flush=True,
                    )
