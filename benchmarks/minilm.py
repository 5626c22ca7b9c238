"""Measure the custom MiniLM encoder against transformers' BertModel on CPU (issue 6).

Both encode the same pre-tokenised sentences with the same weights: batch 1 (one prompt
of 14 tokens) and batch 32 (sentences of 6 to 58 tokens, padded to the longest). The custom
path runs once per backend (torch_sdpa, torch_flash), each timed in alternating rounds
beside the native model (order reversed every round) so that drift hits both alike.
Times are medians over rounds; the ratio is the median over rounds of custom / native
within a round. Target: ratio <= 1.0 (the custom path is not slower).

Both run the same GEMMs per token; the custom path computes everything but attention on
the real tokens only, which is where its margin at batch 32 comes from (about half the
token slots of that batch are padding). Batch 1 has no padding.

One intra-op thread, as in ``attention_overhead``: on a shared 2-core machine a second
OpenMP thread makes the timings noise. Tokenisation is left out: both paths share it.

Run: ``python -m benchmarks minilm``.
"""

from __future__ import annotations

import statistics
from functools import partial

import torch
from structlog.testing import capture_logs
from torch import nn

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from attention.testing import explicit
from benchmarks.attention_overhead import interleaved, one_thread
from components.kinds.minilm_files import Tokens
from components.kinds.minilm_text_encoder import PROMPTS, MiniLmLoader

BACKENDS = ("torch_sdpa", "torch_flash")
# batch size -> (rounds, calls per timed sample)
PLAN = {1: (40, 5), 32: (12, 1)}


def sentences(count: int) -> list[str]:
    """Return ``count`` sentences of varied lengths cut from the repeated prompts."""
    return [
        " ".join([PROMPTS[i % len(PROMPTS)]] * (1 + i % 5))[: 12 + 9 * (i % 32)]
        for i in range(count)
    ]


BATCHES = {1: [PROMPTS[1]], 32: sentences(32)}


def custom(loader: MiniLmLoader, backend: str) -> nn.Module:
    """Build the armed custom encoder with every attention layer on ``backend``."""
    with (
        capture_logs(),  # keep the selection events out of the printed table
        component_attention_scope(
            ComponentRequests(
                component="text_encoder",
                component_backend=explicit(backend),
                allow_global_fallback=True,
            ),
            platform=Platform("cpu"),
        ),
    ):
        module = loader.build("custom")
    arm_layers(module)
    return module


def main() -> None:
    """Print the latency table: custom encoder per backend vs transformers, per batch size."""
    loader = MiniLmLoader.from_options({})
    native = loader.build("native")
    batches: dict[int, Tokens] = {b: loader.tokenizer(text) for b, text in BATCHES.items()}
    print("## MiniLM: custom encoder vs transformers BertModel (CPU, 1 thread, float32)\n")
    print(
        "| backend | batch | tokens (B x S) | real tokens | transformers ms | custom ms "
        "| ratio (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode(), one_thread():
        for backend in BACKENDS:
            module = custom(loader, backend)
            for size, tokens in batches.items():
                rounds, inner = PLAN[size]
                times = interleaved(
                    {"native": partial(native, *tokens), "custom": partial(module, *tokens)},
                    rounds=rounds,
                    inner=inner,
                )
                median = {name: statistics.median(t) for name, t in times.items()}
                ratio = statistics.median(
                    c / n for c, n in zip(times["custom"], times["native"], strict=True)
                )
                shape = "x".join(map(str, tokens.ids.shape))
                print(
                    f"| {backend} | {size} | {shape} | {int(tokens.mask.sum())} "
                    f"| {median['native'] * 1e3:.2f} "
                    f"| {median['custom'] * 1e3:.2f} | {ratio:.3f} |"
                )
    print()


if __name__ == "__main__":
    main()
