"""The tiny DiT with a timestep MLP that changes slowly over steps, as a trained one does.

Its seeded weights make every step look new to a step cache (the first block changes by
about 0.25 from one step to the next, and a cache never skips). Zeroing the first layer
of its timestep MLP on the fastest half of the sinusoid frequencies, as ``make_pipeline
--smooth-time`` does for the folders' DiTs, brings that change to about 0.06.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from benchmarks.make_pipeline import smooth_frequencies
from components.kinds.tiny_dit import TinyDit, TinyDitLoader, TinyDitOptions


def smoothed_dit(loader: TinyDitLoader) -> TinyDit:
    """Build ``loader``'s tiny DiT (custom path, armed), its timestep MLP smoothed."""
    with component_attention_scope(
        ComponentRequests(component="transformer"), platform=Platform("cpu")
    ):
        module = loader.build("custom")
    arm_layers(module)
    first = module.t_mlp[0]
    assert isinstance(first, torch.nn.Linear)
    smooth_frequencies(first)
    assert isinstance(module, TinyDit)
    return module


def write_smoothed_dit(path: Path, seed: int = 7) -> Path:
    """Write the weights of the tiny DiT of ``seed`` (default options), smoothed, to ``path``."""
    module = smoothed_dit(TinyDitLoader(TinyDitOptions(seed=seed)))
    save_file({name: t.contiguous() for name, t in module.state_dict().items()}, str(path))
    return path
