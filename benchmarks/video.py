"""Wan video folders against diffusers, two experts under a budget, the VAE's peak (issue 34).

Writes ``--size bench`` Wan folders (``benchmarks.make_pipeline``: seeded weights), then,
side by side in one run, one intra-op thread:

- **load and request** (Wan 2.1 T2V): ``admit()`` + ``load()`` against
  ``DiffusionPipeline.from_pretrained`` (median of interleaved rounds), the growth of the
  peak RSS of a fresh process over each load (``benchmarks.folders``), and one video
  request through ``request.run_all`` against the pipeline's call with the same arguments.
- **two experts under a one-expert budget** (Wan 2.2 A14B, experts offloaded to disk, so
  a hand-over really reads an expert's file, from the page cache after the first round):
  ``memory.device_budget`` is the largest set a stage holds at once, one expert counted.
  The peak of the resident bytes, the experts' bytes onloaded per request, and the time
  per request against the same folder resident without a budget.
- **VAE decode peak memory**: one process per measurement; the growth of the peak RSS
  over the process with the VAE and the latents in memory, decoding the same latents:
  ours (``AutoencoderKlWanLoader.decode``: a latent frame at a time, each chunk written
  into the video), diffusers' ``AutoencoderKLWan.decode`` (the same chunks, joined by
  ``torch.cat`` as they come, then clamped into a copy), at two clip lengths, and a
  5-frame decode (two latent frames: one chunk of four frames after the first, the
  largest chunk, with little video), which is what ours holds beside the video. glibc
  maps every block of 64 KiB or more on its own (``MALLOC``), so that the peak is the
  live tensors'.

Targets (issue 34): load <= 1.0x time and <= 1.1x RSS; request <= 1.0x; under the budget
the peak <= one expert plus the stage's other uses, an expert's bytes x 2 onloaded per
request (x 1 when the next request starts with the expert already resident) and time <=
1.1x the unbudgeted run; VAE decode peak <= 1.0x diffusers'.

Run: ``python -m benchmarks video``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
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


def one_expert_budget(folder: Path) -> tuple[int, dict[str, int]]:
    """Return the largest set of bytes a stage of ``folder`` holds at once (one expert
    counted), and each component's bytes."""
    spec = load_spec(folder)
    plan = Orchestrator(spec, platform=Platform("cpu")).admit()
    sizes = {name: component.bytes or 0 for name, component in plan.components.items()}
    largest = max(
        sum(sizes[name] for name in held) for stage in spec.stages for held in stage.held_together()
    )
    return largest, sizes


def two_experts(folder: Path, into: Path) -> dict[str, float]:
    """Run A14B requests under a one-expert budget and unbudgeted, interleaved."""
    budget, sizes = one_expert_budget(folder)
    moved: list[Move] = []
    peak = [0]
    budgeted = budget_spec(folder, into, budget)
    resident = budget_spec(folder, into, None)

    def observe(event: Event) -> None:
        if isinstance(event, Move):
            moved.append(event)
            peak[0] = max(peak[0], budgeted.resident_bytes())

    budgeted.observe(observe)
    with threads(1):
        budgeted.load()
        resident.load()
        calls: dict[str, Callable[[], object]] = {
            "ours": lambda: request_ours(budgeted),
            "diffusers": lambda: request_ours(resident),  # the unbudgeted run, as the base
        }
        moved.clear()
        times = interleaved(calls, rounds=ROUNDS, inner=1)
        requests = ROUNDS + 1  # the warm-up too
    onloaded = [m for m in moved if m.component in EXPERTS and m.direction == "onload"]
    expert_bytes = sum(m.bytes for m in onloaded)
    onloads = len(onloaded)
    budgeted.close()
    resident.close()
    return {
        "budget": budget,
        "expert": sizes[EXPERTS[0]],
        "experts": sizes[EXPERTS[0]] + sizes[EXPERTS[1]],
        "peak": peak[0],
        "moved_per_request": expert_bytes / requests,
        "onloads_per_request": onloads / requests,
        "ratio": median_ratio(times),
        "budgeted_s": statistics.median(times["ours"]),
        "resident_s": statistics.median(times["diffusers"]),
    }


DECODE = """
import sys
from pathlib import Path

import torch

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
    else:
        video = loader.decode(module, latents)
print(status("VmHWM:") - before, video.numel() * video.element_size())
"""


MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
"""glibc's settings that give every block of 64 KiB or more its own mapping, returned to the
system when freed: the resident set then follows the live tensors, and its peak is theirs
(with glibc's defaults a freed block stays resident for the next, and the peak depends on
what came before)."""


def decode_peak(folder: Path, method: str, frames: int) -> tuple[int, int]:
    """Return how much ``method``'s decode raises the peak RSS of a fresh process, and the
    bytes of the video it makes (bytes)."""
    result = subprocess.run(
        [sys.executable, "-c", DECODE, str(folder), method, str(frames), *map(str, DECODE_SIZE)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env=os.environ | MALLOC,
    )
    peak, video = result.stdout.split()[-2:]
    return int(peak), int(video)


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
        print(
            "### Wan 2.2 A14B under a one-expert budget (experts offloaded to disk, page "
            "cache warm) against the same folder resident"
        )
        print()
        print("| budget KiB | one expert KiB | both KiB | peak resident KiB | expert onloads "
              "per request | expert bytes onloaded per request | x expert | time budgeted s "
              "| resident s | ratio |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {e['budget'] / 1024:.0f} | {e['expert'] / 1024:.0f} | {e['experts'] / 1024:.0f} "
            f"| {e['peak'] / 1024:.0f} "
            f"| {e['onloads_per_request']:.1f} | {e['moved_per_request'] / 1024:.0f} KiB "
            f"| {e['moved_per_request'] / e['expert']:.2f} | {e['budgeted_s']:.2f} "
            f"| {e['resident_s']:.2f} | {e['ratio']:.3f}x |"
        )
        print()
        print(f"### VAE decode peak memory (bench VAE, {DECODE_SIZE[0]}x{DECODE_SIZE[1]})")
        print()
        print("| frames | video MiB | ours peak MiB | diffusers MiB | ratio "
              "| ours beyond the video MiB | a 5-frame decode's peak MiB |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        chunk, _ = decode_peak(wan, "ours", 1 + CHUNK)
        for frames in DECODE_FRAMES:
            ours, video = decode_peak(wan, "ours", frames)
            theirs, _ = decode_peak(wan, "diffusers", frames)
            print(
                f"| {frames} | {video / 2**20:.1f} | {ours / 2**20:.1f} | {theirs / 2**20:.1f} "
                f"| {ours / theirs:.2f}x | {(ours - video) / 2**20:.1f} | {chunk / 2**20:.1f} |",
                flush=True,
            )
        print()


if __name__ == "__main__":
    main()
