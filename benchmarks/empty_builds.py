"""Build full-size models with no weights: ours against accelerate's empty init.

Every load and every admission of a folder builds its component's class from
``config.json`` with its parameters on ``meta`` (``components.folders.meta.build_empty``):
the library's class on the native path (``FolderLoader.empty``), our module on the
custom path. This times that build at the sizes users load (Flux.1's DiT and VAE,
T5-XXL, Wan 2.1 14B's DiT), side by side with what ``from_pretrained`` does for the
same class: ``accelerate.init_empty_weights(include_buffers=False)`` under the library's
own switch that skips initialisers. CPU time of the building thread, one intra-op
thread, median of interleaved rounds; the ratio is the median of per-round ratios.

Run: ``python -m benchmarks empty_builds``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.attention_overhead import interleaved, threads
from components import registry as kinds
from components.folders.loader import FolderLoader
from components.folders.meta import build_empty
from components.libraries import is_importable

ROUNDS = 7

T5_XXL = {
    "architectures": ["T5EncoderModel"],
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
}
"""The text encoder Flux.1 and SD3 ship (``text_encoder_2`` / ``text_encoder_3``)."""
FLUX_VAE = {
    "_class_name": "AutoencoderKL",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "latent_channels": 16,
    "layers_per_block": 2,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
"""Flux.1's VAE (``vae/config.json``; the rest are diffusers' defaults)."""


def diffusers_config(name: str, **config: Any) -> dict[str, Any]:
    """Return diffusers class ``name``'s full config at its defaults updated by ``config``."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, name).from_config(config)
    return {**dict(model.config), "_class_name": name}


def cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """Return each model's kind and config: full-size Flux.1 DiT and VAE, T5-XXL, Wan 14B."""
    return {
        "Flux.1 DiT (11.9 B)": ("flux_transformer", diffusers_config("FluxTransformer2DModel")),
        "Flux.1 VAE": ("autoencoder_kl", FLUX_VAE),
        "T5-XXL encoder (4.8 B)": ("t5_encoder", T5_XXL),
        "Wan 2.1 14B DiT": (
            "wan_transformer",
            diffusers_config(
                "WanTransformer3DModel", num_attention_heads=40, ffn_dim=13824, num_layers=40
            ),
        ),
    }


def accelerate_empty(loader: FolderLoader) -> nn.Module:
    """Build ``loader``'s library class as ``from_pretrained`` does: under accelerate's
    ``init_empty_weights`` and the library's switch that skips initialisers."""
    from accelerate import init_empty_weights

    model: Any = loader.model_class()
    if loader.library == "transformers":
        from transformers.initialization import no_init_weights

        config = model.config_class.from_dict(loader.config)
        with no_init_weights(), init_empty_weights(include_buffers=False):
            return model(config)  # type: ignore[no-any-return]
    from diffusers.models.modeling_utils import no_init_weights as no_diffusers_init

    with no_diffusers_init(), init_empty_weights(include_buffers=False):
        return model.from_config(loader.config)  # type: ignore[no-any-return]


def accelerate_custom(loader: FolderLoader) -> nn.Module:
    """Build our module of ``loader`` under accelerate's ``init_empty_weights`` (its
    initialisers run, on ``meta``)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return loader.custom_module()


@contextmanager
def folder(config: dict[str, Any]) -> Iterator[Path]:
    """Yield a component folder holding only ``config`` (an empty build reads no weights)."""
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "config.json").write_text(json.dumps(config))
        yield Path(root)


def on_cpu_clock() -> float:
    """Return the calling thread's CPU seconds."""
    return time.thread_time()


def row(name: str, calls: dict[str, Callable[[], object]], params: int) -> str:
    """Time ``calls`` (ours, accelerate) side by side; return the table row."""
    samples = interleaved(calls, rounds=ROUNDS, inner=1, clock=on_cpu_clock)
    ours, theirs = (statistics.median(samples[k]) * 1e3 for k in ("ours", "accelerate"))
    ratio = statistics.median(
        o / t for o, t in zip(samples["ours"], samples["accelerate"], strict=True)
    )
    return f"| {name} | {params / 1e9:.2f} B | {ours:.1f} | {theirs:.1f} | {ratio:.2f}x |"


def rows(name: str, loader: FolderLoader) -> list[str]:
    """Return the rows of ``loader``'s class (native path) and of our module (custom path)."""
    params = sum(p.numel() for p in loader.empty().parameters())
    native: dict[str, Callable[[], object]] = {
        "ours": loader.empty,
        "accelerate": lambda: accelerate_empty(loader),
    }
    custom: dict[str, Callable[[], object]] = {
        "ours": lambda: build_empty(loader.custom_module),
        "accelerate": lambda: accelerate_custom(loader),
    }
    return [row(f"{name}, native", native, params), row(f"{name}, custom", custom, params)]


def main() -> None:
    """Print each model's empty-build CPU time, ours beside accelerate's."""
    if not all(is_importable(name) for name in ("diffusers", "transformers", "accelerate")):
        print("skipped: needs the diffusers and bench extras (diffusers, transformers, accelerate)")
        return
    print(f"### Empty builds of full-size classes, CPU ms, 1 thread, {ROUNDS} interleaved rounds")
    print()
    print("| model, path | parameters | ours ms | accelerate ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    with threads(1):
        for name, (kind, config) in cases().items():
            with folder(config) as path:
                loader = kinds.get(kind).from_options({"path": str(path)})
                assert isinstance(loader, FolderLoader)  # every kind of cases() is a folder's
                for line in rows(name, loader):
                    print(line, flush=True)
    print()
