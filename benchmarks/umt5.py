"""Measure Wan's text encode: UMT5 on the prompt's own tokens vs on 512 (issue 30).

One Wan request encodes its prompt (23 tokens here) and, under guidance, its negative
prompt ("": one token). diffusers runs UMT5 over 512 tokens a prompt, the padding masked;
``Umt5EncoderLoader.encode`` runs the longest prompt's tokens rounded up to 16 and pads the
states with zeros. Both are timed side by side in alternating rounds (order reversed every
round), in CPU seconds of this process (every thread), on the tiny test folder's UMT5 and
on a wider one (``make_pipeline``'s UMT5 with 8 layers of d_model 512), both with seeded
weights. The table gives the median CPU-s of the two encodes, their ratio
and whether the states are equal to the bit.

One intra-op thread, as in ``attention_overhead``: on a shared 2-core machine a second
OpenMP thread makes the timings noise.

Run: ``python -m benchmarks umt5``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from benchmarks.attention_overhead import interleaved, threads
from benchmarks.make_pipeline import DIMS, WORDS, t5, write_pipeline
from components.kinds.umt5_encoder import Umt5EncoderLoader
from components.recipes.folder import FolderPipeline
from components.weights import seed_weights

LENGTH = 512  # Wan's prompt length
PROMPT = " ".join(WORDS[40:62])  # 22 words and </s>
TEXTS = (PROMPT, "")  # the prompt, then the negative prompt: one encode each
ROUNDS = 9


def full_length(loader: Umt5EncoderLoader, module: nn.Module, texts: Sequence[str]) -> torch.Tensor:
    """Encode ``texts`` as diffusers' Wan pipelines do: every prompt padded to 512 tokens,
    the padding masked, its states zeroed."""
    ids, mask = loader.tokenize(texts, LENGTH)
    hidden: torch.Tensor = module(ids, mask).last_hidden_state  # (B, 512, E)
    return hidden * mask[..., None].to(hidden.dtype)


def cpu_seconds(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Return each call's median CPU seconds over ``ROUNDS`` rounds, timed side by side."""
    samples = interleaved(calls, rounds=ROUNDS, inner=1, clock=time.process_time)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    """Print the table: one request's encode at 512 tokens vs at its own, per encoder."""
    with tempfile.TemporaryDirectory() as root:
        loader = FolderPipeline.read(write_pipeline("wan", Path(root) / "wan")).loaders()[
            "text_encoder"
        ]
        assert isinstance(loader, Umt5EncoderLoader)
        wide, _ = t5(DIMS["tiny"]._replace(text=512, text_layers=8), umt5=True)
        seed_weights(wide, 0)
        encoders = {"tiny folder (2 x 64)": loader.build("native").eval(), "8 x 512": wide.eval()}
        tokens = int(loader.tokenize([PROMPT], LENGTH, longest=True).mask.sum())
        print(f"one request: a prompt of {tokens} tokens and the empty negative prompt")
        print(f"{'encoder':<22}{'512 CPU-s':>12}{'own CPU-s':>12}{'ratio':>8}  equal")
        with threads(1), torch.no_grad():
            for name, module in encoders.items():
                calls: dict[str, Callable[[], object]] = {
                    "512": lambda m=module: [full_length(loader, m, [t]) for t in TEXTS],
                    "own": lambda m=module: [loader.encode(m, [t], LENGTH) for t in TEXTS],
                }
                seconds = cpu_seconds(calls)
                ours = [loader.encode(module, [t], LENGTH) for t in TEXTS]
                theirs = [full_length(loader, module, [t]) for t in TEXTS]
                equal = all(map(torch.equal, ours, theirs))
                print(
                    f"{name:<22}{seconds['512']:>12.4f}{seconds['own']:>12.4f}"
                    f"{seconds['own'] / seconds['512']:>8.3f}  {equal}"
                )
