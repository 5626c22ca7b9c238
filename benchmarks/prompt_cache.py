"""The prompt-embedding cache (design §19) under a budget that cannot hold encoder and DiT.

A ``--size bench`` Qwen-Image folder (Qwen2.5-VL text path, its MMDiT and VAE), on the
CPU with ``memory.device_budget`` set to its largest stage, so that each stage evicts
what the one before it left: without a cache, every request onloads the text encoder
and evicts the DiT for it, then the DiT evicts it back. ``REQUESTS`` requests cycle over
``PROMPTS`` distinct prompts (true CFG against one negative prompt), 256x256, 4 steps,
one thread; side by side in one run, without a prompt cache and with
``serving.prompt_cache_bytes`` of 64 MiB: the time of every request after the first
round (median), the text encoder's moves and the bytes moved, all requests together. The
images are compared too (the cache's text is the encoded text, bit for bit).

Run: ``python -m benchmarks prompt_cache``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from attention import Platform
from benchmarks.attention_overhead import threads
from benchmarks.make_pipeline import write_pipeline
from components.batch import Batch
from components.libraries import is_importable
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec, load_spec

PROMPTS = (
    "A watercolour painting of a lighthouse in a storm at dusk",
    "A red fox leaps over the snow at dawn",
)
NEGATIVE = "blurry, dark"
REQUESTS = 12
STEPS = 4
SIZE = (256, 256)
CACHE_BYTES = "64MiB"


def largest_stage(folder: Path) -> int:
    """Return the bytes of the folder's largest stage, as admission declares them."""
    spec = load_spec(folder)
    plan = Orchestrator(spec, platform=Platform("cpu")).admit()
    sizes = {name: component.bytes or 0 for name, component in plan.components.items()}
    return max(sum(sizes[name] for name in stage.uses) for stage in spec.stages)


class Outcome(NamedTuple):
    """What ``REQUESTS`` requests took and moved."""

    seconds: list[float]
    encoder_moves: int
    moved: int
    image: torch.Tensor


def run(folder: Path, budget: int, cache: str | None) -> Outcome:
    """Run ``REQUESTS`` requests under ``budget``; return what they took and moved."""
    table = "" if cache is None else f'[serving]\nprompt_cache_bytes = "{cache}"\n'
    spec = decode_spec(
        f'source = "{folder}"\ndevice = "cpu"\n[memory]\ndevice_budget = {budget}\n{table}'
    )
    moves: list[Move] = []

    def count(event: Event) -> None:
        if isinstance(event, Move):
            moves.append(event)

    seconds = []
    with Orchestrator(spec, platform=Platform("cpu"), observer=count) as orchestrator:
        orchestrator.load()
        for index in range(REQUESTS):
            batch = Batch(
                generator=torch.Generator("cpu").manual_seed(index),
                steps=STEPS,
                prompts=[PROMPTS[index % len(PROMPTS)]],
                negative_prompts=[NEGATIVE],
                guidance_scale=4.0,
                image_size=SIZE,
            )
            started = time.perf_counter()
            with orchestrator.request() as request:
                request.run_all(batch)
            seconds.append(time.perf_counter() - started)
    assert isinstance(batch.images, torch.Tensor)
    encoder = sum(move.component == "text_encoder" for move in moves)
    return Outcome(seconds, encoder, sum(move.bytes for move in moves), batch.images)


def main() -> None:
    """Write the bench folder and print the table."""
    if not all(is_importable(name) for name in ("diffusers", "transformers")):
        print("skipped: needs the diffusers extra (diffusers, transformers)")
        return
    print(
        f"### Prompt cache under a budget of the largest stage (Qwen-Image bench folder, "
        f"{REQUESTS} requests over {len(PROMPTS)} prompts, {SIZE[0]}x{SIZE[1]}, {STEPS} steps)"
    )
    print()
    print(
        "| prompt cache | request s (median, after the first round) | text encoder moves "
        "| moved MiB | against none |"
    )
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as root, threads(1):
        folder = write_pipeline("qwen-image", Path(root) / "qwen-image", size="bench")
        budget = largest_stage(folder)
        rows = {
            name: run(folder, budget, cache)
            for name, cache in (("none", None), (CACHE_BYTES, CACHE_BYTES))
        }
        base = rows["none"]
        base_seconds = statistics.median(base.seconds[len(PROMPTS) :])
        for name, outcome in rows.items():
            seconds = statistics.median(outcome.seconds[len(PROMPTS) :])
            print(
                f"| {name} | {seconds:.3f} | {outcome.encoder_moves} | "
                f"{outcome.moved / 2**20:.1f} | {seconds / base_seconds:.2f}x time, "
                f"{outcome.moved / base.moved:.2f}x bytes |"
            )
        difference = float((rows[CACHE_BYTES].image - base.image).abs().max())
        print()
        print(f"last image, cached against encoded: max abs difference {difference:.1e}")
    print()


if __name__ == "__main__":
    main()
