"""Pipelines from diffusers-format folders against diffusers itself (issue 19).

Writes one ``--size bench`` folder per family (``benchmarks.make_pipeline``: seeded
weights, a few hundred MB each), then, side by side in one run:

- **load**: ours is the orchestrator's: read the folder as a spec, ``admit()`` (configs,
  headers, a ``meta`` build of every class) and ``load()`` (every component built on
  ``meta`` and handed the mapped weights, placed resident), closed again; against
  diffusers' ``DiffusionPipeline.from_pretrained`` (with accelerate, as the ``bench``
  extra installs it: meta init and mapped weights too). Time: median of interleaved
  in-process rounds, page cache warm for both. Peak memory: each in a fresh process,
  the growth of the peak resident set over the process after its imports, every weight
  touched once so both count their pages.
- **request**: one request end to end (prompt in, image out) through the loaded
  orchestrator (``request.run_all``: every stage, its components resident), against the
  pipeline's own call with the same arguments; one intra-op thread; median of
  interleaved rounds. The images are compared too. Each request's CPU time (its thread's,
  where both run all their work) is taken in the same rounds: on a machine shared with
  other work the wall clock also counts the waits for a core, which the CPU ratio does not.

Targets (issue 19): load time <= 1.0x and peak RSS <= 1.1x; request <= 1.05x. Component
offload to host against ``enable_model_cpu_offload`` needs a CUDA device and is skipped
without one.

Run: ``python -m benchmarks folders``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attention import Platform
from benchmarks._progress import no_progress_bars
from benchmarks.attention_overhead import interleaved, threads
from benchmarks.make_pipeline import Family, write_pipeline
from components.batch import Batch
from components.libraries import is_importable
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import load_spec

FAMILIES: tuple[Family, ...] = ("pixart", "flux", "sd3", "qwen-image", "z-image", "flux2-klein")
PROMPT = "A watercolour painting of a lighthouse in a storm at dusk"
NEGATIVE: dict[Family, str] = {"qwen-image": "blurry, dark"}
"""The negative prompt of a class that guides only against one (Qwen-Image's true CFG)."""
STEPS = 4
SIZE = (256, 256)
LOAD_ROUNDS = 5
REQUEST_ROUNDS = 5


def load_ours(folder: Path) -> Orchestrator:
    """Read ``folder`` as a spec, admit it and load it on the CPU (every component resident)."""
    orchestrator = Orchestrator(load_spec(folder), platform=Platform("cpu"))
    orchestrator.admit()
    orchestrator.load()
    return orchestrator


@no_progress_bars()
def load_diffusers(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """Load ``folder`` with diffusers' ``from_pretrained``, its weights in ``dtype``."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder), dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def request_ours(
    orchestrator: Orchestrator,
    guidance: float,
    adapters: dict[str, float] | None = None,
    negative: str | None = None,
) -> torch.Tensor:
    """Run one request through the orchestrator; return the image in [0, 1].

    ``adapters`` are the adapters it names with their scales (``Batch.adapters``).
    """
    batch = Batch(
        generator=torch.Generator("cpu").manual_seed(0),
        steps=STEPS,
        prompts=[PROMPT],
        negative_prompts=None if negative is None else [negative],
        guidance_scale=guidance,
        image_size=SIZE,
        adapters=None if adapters is None else [adapters],
    )
    with orchestrator.request() as request:
        request.run_all(batch)
    assert isinstance(batch.images, torch.Tensor)  # one size: one tensor
    return (batch.images / 2 + 0.5).clamp(0, 1)


def request_diffusers(pipeline: Any, guidance: float, negative: str | None = None) -> torch.Tensor:
    """Run the same request through diffusers' pipeline call (Qwen-Image's guidance scale
    is its ``true_cfg_scale``)."""
    scale = "true_cfg_scale" if type(pipeline).__name__ == "QwenImagePipeline" else "guidance_scale"
    extra = {} if negative is None else {"negative_prompt": negative}
    images: torch.Tensor = pipeline(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(0),
        num_inference_steps=STEPS,
        **{scale: guidance},
        **extra,
        height=SIZE[0],
        width=SIZE[1],
        output_type="pt",
    ).images
    return images


PEAK = """
import sys
from pathlib import Path

import torch

from benchmarks.folders import load_diffusers, load_ours

STATUS = Path("/proc/self/status")


def status(key: str) -> int:
    line = next(l for l in STATUS.read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024


import diffusers, transformers  # noqa: E401 (both paths import both; not counted)

folder, method = Path(sys.argv[1]), sys.argv[2]
before = status("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # the peak starts at the current RSS
loaded = load_ours(folder) if method == "ours" else load_diffusers(folder)
modules = (
    [loaded.module(name) for name in loaded.spec.components]
    if method == "ours"
    else loaded.components.values()
)
touched = sum(
    float(p.sum()) for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()
)
print(status("VmHWM:") - before)
"""


def peak_growth(folder: Path, method: str) -> int:
    """Return how much ``method``'s load raises the peak RSS of a fresh process (bytes)."""
    result = subprocess.run(
        [sys.executable, "-c", PEAK, str(folder), method],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return int(result.stdout.split()[-1])


def median_ratio(samples: dict[str, list[float]]) -> float:
    """Return the median over rounds of ours / theirs within a round."""
    return statistics.median(
        o / t for o, t in zip(samples["ours"], samples["diffusers"], strict=True)
    )


def on_cpu_clock(call: Callable[[], object], seconds: list[float]) -> Callable[[], None]:
    """Wrap ``call`` to append the CPU seconds of the calling thread each call takes."""

    def timed() -> None:
        start = time.thread_time()
        call()
        seconds.append(time.thread_time() - start)

    return timed


def measure(family: Family, folder: Path) -> dict[str, float]:
    """Measure the load and one request of ``family``'s bench folder, ours beside diffusers'."""
    with threads(1):
        loads: dict[str, Callable[[], object]] = {
            "ours": lambda: load_ours(folder).close(),  # closed, so rounds do not pile up
            "diffusers": lambda: load_diffusers(folder),
        }
        load_times = interleaved(loads, rounds=LOAD_ROUNDS, inner=1)
        ours, theirs = load_ours(folder), load_diffusers(folder)
        assert ours.recipe is not None
        guidance = ours.recipe.default_guidance
        negative = NEGATIVE.get(family)
        cpu: dict[str, list[float]] = {"ours": [], "diffusers": []}
        requests = {
            "ours": on_cpu_clock(
                lambda: request_ours(ours, guidance, negative=negative), cpu["ours"]
            ),
            "diffusers": on_cpu_clock(
                lambda: request_diffusers(theirs, guidance, negative), cpu["diffusers"]
            ),
        }
        request_times = interleaved(requests, rounds=REQUEST_ROUNDS, inner=1)
        ours_image = request_ours(ours, guidance, negative=negative)
        difference = float((ours_image - request_diffusers(theirs, guidance, negative)).abs().max())
        ours.close()
    rss = {method: peak_growth(folder, method) for method in ("ours", "diffusers")}
    return {
        "load_ours": statistics.median(load_times["ours"]),
        "load_diffusers": statistics.median(load_times["diffusers"]),
        "load_ratio": median_ratio(load_times),
        "rss_ours": rss["ours"],
        "rss_diffusers": rss["diffusers"],
        "request_ours": statistics.median(request_times["ours"]),
        "request_diffusers": statistics.median(request_times["diffusers"]),
        "request_ratio": median_ratio(request_times),
        "request_cpu_ratio": median_ratio({name: times[1:] for name, times in cpu.items()}),
        "max_difference": difference,
    }


def main() -> None:
    """Write the bench folders and print the table."""
    if not all(is_importable(name) for name in ("diffusers", "transformers", "accelerate")):
        print("skipped: needs the diffusers and bench extras (diffusers, transformers, accelerate)")
        return
    print(
        f"### Folders against diffusers (bench folders, {SIZE[0]}x{SIZE[1]}, {STEPS} steps, "
        f"{LOAD_ROUNDS} load and {REQUEST_ROUNDS} request rounds)"
    )
    print()
    print(
        "| pipeline | MiB | load ours s | diffusers s | ratio | peak RSS ours MiB | diffusers MiB "
        "| ratio | request ours s | diffusers s | ratio | CPU ratio | max abs diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            folder = write_pipeline(family, Path(root) / family, size="bench")
            size = sum(f.stat().st_size for f in folder.rglob("*.safetensors")) / 2**20
            m = measure(family, folder)
            print(
                f"| {family} | {size:.0f} | {m['load_ours']:.3f} | {m['load_diffusers']:.3f} "
                f"| {m['load_ratio']:.2f}x | {m['rss_ours'] / 2**20:.0f} "
                f"| {m['rss_diffusers'] / 2**20:.0f} | {m['rss_ours'] / m['rss_diffusers']:.2f}x "
                f"| {m['request_ours']:.2f} | {m['request_diffusers']:.2f} "
                f"| {m['request_ratio']:.3f}x | {m['request_cpu_ratio']:.3f}x "
                f"| {m['max_difference']:.1e} |",
                flush=True,
            )
    print()
    if not torch.cuda.is_available():
        print("component offload to host vs enable_model_cpu_offload: skipped, no CUDA device")
        print()


if __name__ == "__main__":
    main()
