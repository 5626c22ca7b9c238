"""Our architectures against the libraries' classes, on the same weights (issue 20).

Each comparison is one function that builds both sides from one folder written by the
library itself and returns a ``Row`` per thread count; ``main`` runs every comparison in
``COMPARISONS`` with one intra-op thread and with all of them, side by side in one run.
A new comparison (a DiT step, mixed sizes) is a function added to ``COMPARISONS``.

Encoders (``t5``, ``clip``): one forward of our custom path (``loader.build("custom")``,
its default backend) against transformers' class from ``from_pretrained``, on the same
token ids: T5 v1.1-style (gated GELU) 1024 wide, 8 layers, two PixArt prompts padded to
120 tokens with the padding masked; CLIP-L-style (quick GELU) 768 wide, 12 layers, two
prompts padded to 77, hidden states asked for (as SD3 and Flux use them). The VAE
(``vae``): one decode of our custom path against diffusers' ``AutoencoderKL``, SD's layout
at half width, a 16x16 latent to a 128x128 image. Time: median of interleaved rounds.
Target: ours <= 1.0x.

Run: ``python -m benchmarks archs``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from structlog.testing import capture_logs
from torch import nn

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from benchmarks.attention_overhead import interleaved
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


Comparison = Callable[[Path, tuple[int, ...]], list[Row]]
"""Build both sides in a folder of its own, then time them at each thread count."""


@contextmanager
def threads(count: int) -> Iterator[None]:
    """Run torch with ``count`` intra-op threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def custom_module(loader: CustomFolderLoader) -> nn.Module:
    """Build ``loader``'s custom path with its default backends, armed; events swallowed."""
    with (
        capture_logs(),
        component_attention_scope(ComponentRequests(component="bench"), platform=Platform("cpu")),
    ):
        module = loader.build("custom")
    arm_layers(module)
    return module


def timed(
    name: str,
    ours: Callable[[], torch.Tensor],
    theirs: Callable[[], torch.Tensor],
    counts: tuple[int, ...],
) -> list[Row]:
    """Time ``ours`` against ``theirs`` at each thread count; compare their outputs once."""
    with torch.inference_mode():
        mine, library = ours(), theirs()
        error = float((mine - library).abs().max() / library.abs().max())
        rows = []
        for count in counts:
            with threads(count):
                samples = interleaved({"ours": ours, "theirs": theirs}, rounds=ROUNDS, inner=1)
            rows.append(
                Row(
                    name,
                    count,
                    1e3 * statistics.median(samples["ours"]),
                    1e3 * statistics.median(samples["theirs"]),
                    error,
                )
            )
    return rows


def token_ids(vocab: int, length: int, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return seeded ids ``(B, L)`` whose first ``real`` tokens are real, and that mask."""
    ids = torch.randint(3, vocab, (BATCH, length), generator=torch.Generator().manual_seed(0))
    keep = (torch.arange(length) < real).to(torch.int64).expand(BATCH, -1)
    return ids * keep, keep


def compare_t5(folder: Path, counts: tuple[int, ...]) -> list[Row]:
    """T5 encoder, masked, as PixArt runs it: ours against ``T5EncoderModel``."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=32128, d_model=1024, d_kv=64, d_ff=2816, num_layers=8, num_heads=16,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    )  # fmt: skip
    T5EncoderModel(config).save_pretrained(str(folder))
    loader = T5EncoderLoader.from_options({"path": str(folder)})
    ours, theirs = custom_module(loader), T5EncoderModel.from_pretrained(str(folder)).eval()
    ids, keep = token_ids(config.vocab_size, T5_TOKENS, T5_REAL)
    return timed(
        "T5 encoder (1024 wide, 8 layers, 2 x 120 tokens, masked)",
        lambda: ours(ids, keep),
        lambda: theirs(ids, attention_mask=keep).last_hidden_state,
        counts,
    )


def compare_clip(folder: Path, counts: tuple[int, ...]) -> list[Row]:
    """CLIP text model with hidden states, as SD3 runs it: ours against ``CLIPTextModel``."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=CLIP_TOKENS, hidden_act="quick_gelu",
        eos_token_id=2,
    )  # fmt: skip
    CLIPTextModel(config).save_pretrained(str(folder))
    loader = ClipTextEncoderLoader.from_options({"path": str(folder)})
    ours, theirs = custom_module(loader), CLIPTextModel.from_pretrained(str(folder)).eval()
    ids, _ = token_ids(config.vocab_size, CLIP_TOKENS, CLIP_TOKENS)

    def library() -> torch.Tensor:
        out: Any = theirs(ids, output_hidden_states=True)
        return torch.cat([out.pooler_output[:, None], out.hidden_states[-2]], dim=1)

    def mine() -> torch.Tensor:
        states = ours(ids)
        return torch.cat([states.pooled[:, None], states.penultimate], dim=1)

    return timed("CLIP text model (768 wide, 12 layers, 2 x 77 tokens)", mine, library, counts)


def compare_vae(folder: Path, counts: tuple[int, ...]) -> list[Row]:
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
    ours, theirs = custom_module(loader), AutoencoderKL.from_pretrained(str(folder)).eval()
    draw = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, VAE_LATENT, VAE_LATENT, generator=draw)
    image = VAE_LATENT * loader.scale_factor
    return timed(
        f"VAE decode ({', '.join(map(str, VAE_CHANNELS))} channels, 1 x {image}x{image})",
        lambda: loader.decode(ours, latents),
        lambda: loader.decode(theirs, latents),
        counts,
    )


COMPARISONS: dict[str, Comparison] = {"t5": compare_t5, "clip": compare_clip, "vae": compare_vae}


def main() -> None:
    """Print every comparison at one thread and at all of them."""
    if not is_importable("transformers"):
        print(
            "skipped: transformers is not installed (pip install 'pipeline-lifecycle[diffusers]')"
        )
        return
    counts = tuple(sorted({1, os.cpu_count() or 1}))
    print("| comparison | threads | ours ms | theirs ms | ours / theirs | max rel. error |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for key, compare in COMPARISONS.items():
            for row in compare(Path(scratch) / key, counts):
                print(
                    f"| {row.name} | {row.threads} | {row.ours_ms:.1f} | {row.theirs_ms:.1f} | "
                    f"{row.ratio:.2f}x | {row.error:.1e} |",
                    flush=True,
                )
