"""Wan video folders against diffusers, two experts under a budget, the VAE's peak (issue 34).

Writes ``--size bench`` Wan folders (``benchmarks.make_pipeline``: seeded weights), then,
side by side in one run, one intra-op thread:

- **load and request** (Wan 2.1 T2V): ``admit()`` + ``load()`` against
  ``DiffusionPipeline.from_pretrained`` (median of interleaved rounds), the growth of the
  peak RSS of a fresh process over each load (``benchmarks.folders``), and one video
  request through ``request.run_all`` against the pipeline's call with the same arguments.
- **two experts under a budget** (Wan 2.2 A14B, experts offloaded to disk, so a
  hand-over really reads an expert's file, from the page cache after the first round),
  three runs side by side: ``memory.device_budget`` the largest set a stage holds at once,
  one expert counted (where no prefetch fits: a prefetched expert would be evicted by the
  next encode); one expert beside the largest other stage (the next request's first
  expert onloads while a request decodes, ``reason = "prefetch"``); resident without a
  budget. The peak of the resident bytes, the experts' onloads and bytes per request (and
  how many were prefetches), and the time per request against the resident run.
- **VAE decode peak memory**: one process per measurement; the growth of the peak RSS
  over the process with the VAE and the latents in memory, decoding the same latents:
  ours (``AutoencoderKlWanLoader.decode``: a latent frame at a time, each chunk written
  into the video), diffusers' ``AutoencoderKLWan.decode`` (the same chunks, joined by
  ``torch.cat`` as they come, then clamped into a copy), at two clip lengths, and a
  5-frame decode (two latent frames: one chunk of four frames after the first, the
  largest chunk, with little video), which is what ours holds beside the video; and a
  whole-clip decode: the decoder on the first latent frame, then on all the others in one
  call (the same causal cache, every frame's activations at once), with its largest
  difference from ours. glibc
  maps every block of 64 KiB or more on its own (``MALLOC``), so that the peak is the
  live tensors'.

Targets (issue 34): load <= 1.0x time and <= 1.1x RSS; request <= 1.0x; under the budget
the peak <= one expert plus the stage's other uses, an expert's bytes x 2 onloaded per
request (x 1 when the next request starts with the expert already resident) and time <=
1.1x the unbudgeted run; VAE decode peak <= 1.0x diffusers' (and below a whole-clip
decode's).

Run: ``python -m benchmarks video``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from attention import Platform
from benchmarks.attention_overhead import interleaved, threads
from benchmarks.folders import load_diffusers, load_ours, median_ratio, peak_growth
from benchmarks.make_pipeline import write_pipeline
from components.batch import Batch
from components.libraries import is_importable
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec, load_spec

PROMPT = "A red fox runs through the snow at dawn, cinematic"
STEPS = 4
FRAMES = 9
SIZE = (128, 128)
ROUNDS = 5
EXPERTS = ("transformer", "transformer_2")
DECODE_SIZE = (256, 256)
DECODE_FRAMES = (9, 33)
CHUNK = 4
"""The frames a latent frame after the first decodes into: a decode of ``1 + CHUNK`` frames
holds the largest chunk's activations, and little video."""


def request_ours(orchestrator: Orchestrator) -> torch.Tensor:
    """Run one video request through the orchestrator; return the video in [0, 1]."""
    batch = Batch(
        generator=torch.Generator("cpu").manual_seed(0),
        steps=STEPS,
        prompts=[PROMPT],
        image_size=SIZE,
        frames=FRAMES,
    )
    with orchestrator.request() as request:
        request.run_all(batch)
    assert batch.videos is not None
    return (batch.videos[0] / 2 + 0.5).clamp(0, 1)


def request_diffusers(pipeline: Any) -> torch.Tensor:
    """Run the same request through diffusers' pipeline call; the video ``(3, F, H, W)``."""
    frames: torch.Tensor = pipeline(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(0),
        num_inference_steps=STEPS,
        height=SIZE[0],
        width=SIZE[1],
        num_frames=FRAMES,
        output_type="pt",
    ).frames
    return frames[0].transpose(0, 1)


def load_and_request(folder: Path) -> dict[str, float]:
    """Measure the load and one request of the Wan 2.1 folder, ours beside diffusers'."""
    with threads(1):
        loads: dict[str, Callable[[], object]] = {
            "ours": lambda: load_ours(folder).close(),
            "diffusers": lambda: load_diffusers(folder),
        }
        load_times = interleaved(loads, rounds=ROUNDS, inner=1)
        ours, theirs = load_ours(folder), load_diffusers(folder)
        requests: dict[str, Callable[[], object]] = {
            "ours": lambda: request_ours(ours),
            "diffusers": lambda: request_diffusers(theirs),
        }
        request_times = interleaved(requests, rounds=ROUNDS, inner=1)
        difference = float((request_ours(ours) - request_diffusers(theirs)).abs().max())
        ours.close()
    rss = {method: peak_growth(folder, method) for method in ("ours", "diffusers")}
    return {
        "load_ratio": median_ratio(load_times),
        "load_ours": statistics.median(load_times["ours"]),
        "rss_ratio": rss["ours"] / rss["diffusers"],
        "rss_ours": rss["ours"],
        "request_ratio": median_ratio(request_times),
        "request_ours": statistics.median(request_times["ours"]),
        "difference": difference,
    }


def budget_spec(folder: Path, into: Path, budget: int | None) -> Orchestrator:
    """Return an orchestrator of ``folder`` with both experts offloaded to disk under
    ``budget`` (every component resident and no budget with None)."""
    lines = [f'source = "{folder}"', 'device = "cpu"']
    if budget is not None:
        lines += ["[memory]", 'offload_target = "disk"', f'offload_dir = "{into}"']
        lines.append(f"device_budget = {budget}")
        for name in EXPERTS:
            lines += [f"[components.{name}]", 'residency = "component_offload"']
    spec = decode_spec("\n".join(lines) + "\n")
    return Orchestrator(spec, platform=Platform("cpu"))


def budgets(folder: Path) -> tuple[int, int, dict[str, int]]:
    """Return the largest set of bytes a stage of ``folder`` holds at once (one expert
    counted: the one-expert budget), one expert beside the largest other stage (the budget
    that lets the first expert come in while a request decodes), and each component's
    bytes."""
    spec = load_spec(folder)
    plan = Orchestrator(spec, platform=Platform("cpu")).admit()
    sizes = {name: component.bytes or 0 for name, component in plan.components.items()}
    largest = max(
        sum(sizes[name] for name in held) for stage in spec.stages for held in stage.held_together()
    )
    others = max(sum(sizes[n] for n in stage.uses) for stage in spec.stages if not stage.windows)
    return largest, sizes[EXPERTS[0]] + others, sizes


RUNS = ("one expert", "prefetch", "resident")
"""The A14B runs side by side: under the one-expert budget (no prefetch fits), under one
expert beside the largest other stage (the first expert comes in during decode), and
resident without a budget."""


def two_experts(folder: Path, into: Path) -> dict[str, dict[str, float]]:
    """Run A14B requests under each of ``RUNS``, interleaved; return each run's figures."""
    one, ahead, sizes = budgets(folder)
    limits = {"one expert": one, "prefetch": ahead, "resident": None}
    orchestrators = {
        run: budget_spec(folder, into / run.replace(" ", "-"), limit)
        for run, limit in limits.items()
    }
    moved: dict[str, list[Move]] = {run: [] for run in RUNS}
    peak = dict.fromkeys(RUNS, 0)

    def observer(run: str) -> Callable[[Event], None]:
        def observe(event: Event) -> None:
            if isinstance(event, Move):
                moved[run].append(event)
                peak[run] = max(peak[run], orchestrators[run].resident_bytes())

        return observe

    for run, orchestrator in orchestrators.items():
        orchestrator.observe(observer(run))
    with threads(1):
        for orchestrator in orchestrators.values():
            orchestrator.load()
        calls: dict[str, Callable[[], object]] = {
            run: partial(request_ours, o) for run, o in orchestrators.items()
        }
        for moves in moved.values():
            moves.clear()
        times = interleaved(calls, rounds=ROUNDS, inner=1)
        requests = ROUNDS + 1  # the warm-up too
    figures = {}
    for run in RUNS:
        onloads = [m for m in moved[run] if m.component in EXPERTS and m.direction == "onload"]
        figures[run] = {
            "budget": limits[run] or 0,
            "peak": peak[run],
            "onloads_per_request": len(onloads) / requests,
            "moved_per_request": sum(m.bytes for m in onloads) / requests,
            "prefetched_per_request": sum(m.reason == "prefetch" for m in onloads) / requests,
            "seconds": statistics.median(times[run]),
            "ratio": statistics.median(
                t / r for t, r in zip(times[run], times["resident"], strict=True)
            ),
        }
        orchestrators[run].close()
    figures["sizes"] = {
        "expert": sizes[EXPERTS[0]],
        "experts": sizes[EXPERTS[0]] + sizes[EXPERTS[1]],
        "vae": sizes["vae"],
        "text_encoder": sizes["text_encoder"],
    }
    return figures


DECODE = """
import sys
from pathlib import Path

import torch

from components.kinds.autoencoder_kl_wan import _cache
from components.recipes.folder import FolderPipeline

STATUS = Path("/proc/self/status")


def status(key: str) -> int:
    line = next(l for l in STATUS.read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024


folder, method, frames, height, width = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
torch.set_num_threads(1)
loader = FolderPipeline.read(Path(folder)).loaders()["vae"]
module = loader.build("native")
scale = loader.scale_factor
latent_frames = (frames - 1) // loader.temporal_factor + 1
shape = (1, loader.latent_channels, latent_frames, height // scale, width // scale)
latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    loader.decode(module, latents[:, :, :2])  # warm-up: first-call allocations
    before = status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts at the current RSS
    if method == "diffusers":  # diffusers' own decode: the chunks joined as they come
        video = module.decode(latents).sample
    elif method == "whole":  # the first latent frame, then the rest of the clip at once
        x = module.post_quant_conv(latents)
        cache = _cache(module.decoder)
        first = module.decoder(x[:, :, :1], feat_cache=cache, feat_idx=[0], first_chunk=True)
        rest = module.decoder(x[:, :, 1:], feat_cache=cache, feat_idx=[0])
        video = torch.cat([first, rest], dim=2).clamp(-1.0, 1.0)
    else:
        video = loader.decode(module, latents)
    peak = status("VmHWM:") - before
    # how far the whole-clip decode is from the chunked one (0 for the chunked itself)
    difference = (video - loader.decode(module, latents)).abs().max().item()
print(peak, video.numel() * video.element_size(), difference)
"""


MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
"""glibc's settings that give every block of 64 KiB or more its own mapping, returned to the
system when freed: the resident set then follows the live tensors, and its peak is theirs
(with glibc's defaults a freed block stays resident for the next, and the peak depends on
what came before)."""


def decode_peak(folder: Path, method: str, frames: int) -> tuple[int, int, float]:
    """Return how much ``method``'s decode raises the peak RSS of a fresh process, the bytes
    of the video it makes, and its largest difference from ours."""
    result = subprocess.run(
        [sys.executable, "-c", DECODE, str(folder), method, str(frames), *map(str, DECODE_SIZE)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env=os.environ | MALLOC,
    )
    peak, video, difference = result.stdout.split()[-3:]
    return int(peak), int(video), float(difference)


def main() -> None:
    """Write the bench folders and print the tables."""
    if not all(is_importable(name) for name in ("diffusers", "transformers", "accelerate")):
        print("skipped: needs the diffusers and bench extras (diffusers, transformers, accelerate)")
        return
    with tempfile.TemporaryDirectory() as root:
        wan = write_pipeline("wan", Path(root) / "wan", size="bench")
        a14b = write_pipeline("wan-a14b", Path(root) / "wan-a14b", size="bench")
        print(
            f"### Wan against diffusers (bench folder, {FRAMES} frames {SIZE[0]}x{SIZE[1]}, "
            f"{STEPS} steps, {ROUNDS} interleaved rounds, 1 thread)"
        )
        print()
        m = load_and_request(wan)
        print("| load ours s | ratio | peak RSS ours MiB | ratio | request ours s | ratio "
              "| max abs diff |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {m['load_ours']:.3f} | {m['load_ratio']:.2f}x | {m['rss_ours'] / 2**20:.0f} "
            f"| {m['rss_ratio']:.2f}x | {m['request_ours']:.2f} | {m['request_ratio']:.3f}x "
            f"| {m['difference']:.1e} |"
        )
        print()
        e = two_experts(a14b, Path(root) / "offload")
        z = e["sizes"]
        print(
            "### Wan 2.2 A14B under a budget (experts offloaded to disk, page cache warm) "
            "against the same folder resident"
        )
        print()
        print(
            f"One expert {z['expert'] / 1024:.0f} KiB (both {z['experts'] / 1024:.0f} KiB), "
            f"VAE {z['vae'] / 1024:.0f} KiB, text encoder {z['text_encoder'] / 1024:.0f} KiB."
        )
        print()
        print("| run | budget KiB | peak resident KiB | expert onloads per request | of them "
              "prefetched | expert bytes onloaded per request | x expert | time s "
              "| vs resident |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for run in RUNS:
            f = e[run]
            print(
                f"| {run} | {f['budget'] / 1024:.0f} | {f['peak'] / 1024:.0f} "
                f"| {f['onloads_per_request']:.1f} | {f['prefetched_per_request']:.1f} "
                f"| {f['moved_per_request'] / 1024:.0f} KiB "
                f"| {f['moved_per_request'] / z['expert']:.2f} | {f['seconds']:.2f} "
                f"| {f['ratio']:.3f}x |"
            )
        print()
        print(f"### VAE decode peak memory (bench VAE, {DECODE_SIZE[0]}x{DECODE_SIZE[1]})")
        print()
        print("| frames | video MiB | ours peak MiB | diffusers MiB | ratio | whole clip MiB "
              "| ratio | whole clip max abs diff | ours beyond the video MiB "
              "| a 5-frame decode's peak MiB |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        chunk, _, _ = decode_peak(wan, "ours", 1 + CHUNK)
        for frames in DECODE_FRAMES:
            ours, video, _ = decode_peak(wan, "ours", frames)
            theirs, _, _ = decode_peak(wan, "diffusers", frames)
            whole, _, difference = decode_peak(wan, "whole", frames)
            print(
                f"| {frames} | {video / 2**20:.1f} | {ours / 2**20:.1f} | {theirs / 2**20:.1f} "
                f"| {ours / theirs:.2f}x | {whole / 2**20:.1f} | {ours / whole:.2f}x "
                f"| {difference:.1e} | {(ours - video) / 2**20:.1f} | {chunk / 2**20:.1f} |",
                flush=True,
            )
        print()


if __name__ == "__main__":
    main()
