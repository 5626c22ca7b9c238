"""Compiled and quantized DiTs (design §17): ours against diffusers' class given the same treatment.

A ``--size bench`` Flux folder (8 double + 8 single blocks, width 384) written with a
smoothed time embedding (so that the step cache of the combined row skips steps), 256x256,
seed 0, one thread. Side by side in one run:

- **ours**: the orchestrator with ``[components.transformer]`` ``compile`` and
  ``quantization`` (and ``dtype = "bfloat16"``);
- **diffusers**: its ``FluxPipeline`` with ``transformer.compile_repeated_blocks()``
  (regional compilation, through the same counting inductor backend as ours), torchao's
  ``quantize_`` with the same config, and the pipeline loaded in bfloat16.

Per setting: CPU-seconds per denoising step (the lowest of ``ROUNDS`` interleaved rounds
of the transformer's forward calls in a ``STEPS``-step request, after a first request that
warms and compiles), the speed-up over that library's float32 eager step and the ratio to
diffusers' same treatment, the PSNR of the latents against that library's float32 eager
ones, the seconds inductor took at warm-up (graphs built) and the first request's wall
time and CPU-seconds, the C++ compiler's included (load excluded, compile included: sglang
saw compile regress it); inductor's once-a-process setup is paid before either library
compiles (``warm_inductor``). Then the combined goal: our
cache (first_block) + int8_dynamic + blocks on a 28-step request against diffusers'
eager float32 pipeline call, with the PSNR of the decoded image.

Run: ``python -m benchmarks accel``.
"""

from __future__ import annotations

import math
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from benchmarks.cache import decode
from benchmarks.folders import load_diffusers
from benchmarks.make_pipeline import write_pipeline
from components.batch import Batch
from components.compile import Compilation
from components.quantize import torchao_config
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec

STEPS = 4
COMBINED_STEPS = 28
SIZE = (256, 256)
PROMPT = "a red fox leaps over the snow at dawn, golden light"
GUIDANCE = 3.5
ROUNDS = 3


class Setting(NamedTuple):
    """One treatment, given alike to our transformer and to diffusers'."""

    name: str
    compile: str = "off"
    quantization: str = "off"
    dtype: str = "float32"

    def keys(self) -> str:
        """Return our ``[components.transformer]`` keys for it."""
        return f'compile = "{self.compile}"\nquantization = "{self.quantization}"\n'


EAGER = Setting("float32 eager")
SETTINGS = (
    EAGER,
    Setting("compile blocks", compile="blocks"),
    Setting("int8_dynamic", quantization="int8_dynamic"),
    Setting("int8_dynamic + blocks", compile="blocks", quantization="int8_dynamic"),
    Setting("int8_weight_only", quantization="int8_weight_only"),
    Setting("float8_weight_only", quantization="float8_weight_only"),
    Setting("bfloat16 eager", dtype="bfloat16"),
)
COMBINED = Setting("cache + int8_dynamic + blocks", compile="blocks", quantization="int8_dynamic")

CACHE = '[components.transformer.cache]\nmethod = "first_block"\nthreshold = 0.12\n'


class ForwardClock:
    """Sum the CPU-seconds a module's forward calls take (hooks outside any compiled code)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._started = 0.0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _start(self, *args: object) -> None:
        self._started = time.process_time()

    def _stop(self, *args: object) -> None:
        self.seconds += time.process_time() - self._started

    def take(self) -> float:
        """Return the seconds summed since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Runner(NamedTuple):
    """One library's setting, loaded: a request of ``steps`` returning (denoise CPU-seconds,
    latents, image in [0, 1]), what its compile counted, its first request's wall time
    and CPU-seconds (``cpu_seconds``)."""

    library: str
    name: str
    run: Callable[[int], tuple[float, torch.Tensor, torch.Tensor]]
    compiled: Compilation | None
    first_s: float
    first_cpu_s: float

    def compile_cell(self) -> str:
        """Return inductor's seconds and graphs (and recompiles) at warm-up, or a dash."""
        if self.compiled is None:
            return "-"
        return f"{self.compiled.seconds:.1f} ({self.compiled.graphs} graphs)"


def cpu_seconds() -> float:
    """Return the CPU-seconds of this process and of the children it has waited for.

    Inductor compiles in this process (``compile_threads = 1``, set by ``main``) and runs
    the C++ compiler as children it waits for: a compile's CPU-seconds, which the other
    jobs of a shared machine do not stretch as they stretch its wall time.
    """
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def first_request(run: Callable[[int], object]) -> tuple[float, float]:
    """Run the first request of ``STEPS``; return its wall time and its CPU-seconds."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    run(STEPS)
    return time.perf_counter() - wall, cpu_seconds() - cpu


def psnr(ours: torch.Tensor, reference: torch.Tensor, peak: float | None = None) -> float:
    """Return the PSNR (dB) of ``ours`` against ``reference`` (peak: its range unless given)."""
    mse = float(((ours.double() - reference.double()) ** 2).mean())
    top = float(reference.max() - reference.min()) if peak is None else peak
    return math.inf if mse == 0 else 10 * math.log10(top**2 / mse)


def ours(folder: Path, setting: Setting, cache: str = "") -> Runner:
    """Load ``folder`` with ``setting`` on its transformer; warm it with one request."""
    text = f'source = "{folder}"\ndevice = "cpu"\ndtype = "{setting.dtype}"\n'
    text += f"[components.transformer]\n{setting.keys()}{cache}"
    orchestrator = Orchestrator(decode_spec(text))
    orchestrator.admit()
    orchestrator.load()
    _held.append(orchestrator)
    clock = ForwardClock(orchestrator.module("transformer"))

    def run(steps: int) -> tuple[float, torch.Tensor, torch.Tensor]:
        batch = Batch(
            generator=torch.Generator("cpu").manual_seed(0),
            steps=steps,
            prompts=[PROMPT],
            guidance_scale=GUIDANCE,
            image_size=SIZE,
        )
        with orchestrator.request() as request:
            request.run("encode", batch)
            clock.take()
            request.run("denoise", batch)
            seconds = clock.take()
            latents = torch.stack(list(batch.latents or [])).float()
            request.run("decode", batch)
        assert isinstance(batch.images, torch.Tensor)
        return seconds, latents, (batch.images.float() / 2 + 0.5).clamp(0, 1)

    first_s, first_cpu_s = first_request(run)
    compiled = orchestrator.compilations().get("transformer")
    return Runner("ours", setting.name, run, compiled, first_s, first_cpu_s)


_held: list[Orchestrator] = []


def theirs(folder: Path, setting: Setting) -> Runner:
    """Load diffusers' pipeline of ``folder`` and give its transformer ``setting``: torchao's
    ``quantize_`` with the config ours applies, ``compile_repeated_blocks`` (counted by the
    same inductor backend as ours); warm it with one request."""
    pipeline = load_diffusers(folder, getattr(torch, setting.dtype))
    transformer = pipeline.transformer
    if setting.quantization != "off":
        from torchao.quantization import quantize_  # type: ignore[import-untyped]

        quantize_(transformer, torchao_config(setting.quantization))
    compiled = None
    if setting.compile == "blocks":
        compiled = Compilation("blocks")
        transformer.compile_repeated_blocks(backend=compiled.backend)
        transformer.register_forward_pre_hook(compiled.count_call)
    clock = ForwardClock(transformer)

    def run(steps: int) -> tuple[float, torch.Tensor, torch.Tensor]:
        clock.take()
        latents = pipeline(
            PROMPT,
            generator=torch.Generator("cpu").manual_seed(0),
            num_inference_steps=steps,
            guidance_scale=GUIDANCE,
            height=SIZE[0],
            width=SIZE[1],
            output_type="latent",
        ).images
        seconds = clock.take()
        return seconds, latents.float(), decode(pipeline, latents).float()

    return Runner("diffusers", setting.name, run, compiled, *first_request(run))


def interleaved(
    runners: list[Runner], steps: int
) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    """Run every runner once a round, ``ROUNDS`` rounds, alternating the order; each one's
    lowest seconds with its last outputs."""
    found: list[list[Any]] = [[math.inf, None, None] for _ in runners]
    order = list(range(len(runners)))
    for round_ in range(ROUNDS):
        for i in order if round_ % 2 == 0 else reversed(order):
            seconds, latents, image = runners[i].run(steps)
            found[i] = [min(found[i][0], seconds), latents, image]
    return [(s, latents, image) for s, latents, image in found]


def step_table(folder: Path) -> None:
    """Print CPU-seconds per denoising step for every setting of both libraries."""
    runners = []
    for setting in SETTINGS:
        runners.append(ours(folder, setting))
        runners.append(theirs(folder, setting))
    results = dict(
        zip(((r.library, r.name) for r in runners), interleaved(runners, STEPS), strict=True)
    )
    print(
        f"### Compiled and quantized Flux DiT (bench folder, {SIZE[0]}x{SIZE[1]}, {STEPS} "
        f"steps, CPU-seconds per step, lowest of {ROUNDS} interleaved rounds)"
    )
    print()
    print(
        "| library | setting | s / step | speed-up over its float32 eager | ours / diffusers "
        "| PSNR latents dB | inductor s at warm-up | first request s | first request CPU-s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for runner in runners:
        seconds, latents, _ = results[(runner.library, runner.name)]
        reference = results[(runner.library, EAGER.name)]
        other = results[("diffusers", runner.name)][0]
        ratio = f"{seconds / other:.2f}x" if runner.library == "ours" else ""
        print(
            f"| {runner.library} | {runner.name} | {seconds / STEPS:.3f} "
            f"| {reference[0] / seconds:.2f}x | {ratio} "
            f"| {psnr(latents, reference[1]):.1f} | {runner.compile_cell()} "
            f"| {runner.first_s:.1f} | {runner.first_cpu_s:.1f} |",
            flush=True,
        )


def combined_table(folder: Path) -> None:
    """Print our cache + int8_dynamic + blocks against diffusers' eager float32 call."""
    combined = ours(folder, COMBINED, CACHE)
    eager = theirs(folder, EAGER)
    found: dict[str, list[float]] = {"ours": [], "diffusers": []}
    images: dict[str, torch.Tensor] = {}
    for round_ in range(ROUNDS):
        for runner in (combined, eager) if round_ % 2 == 0 else (eager, combined):
            started = time.process_time()
            _, _, image = runner.run(COMBINED_STEPS)
            found[runner.library].append(time.process_time() - started)
            images[runner.library] = image
    ours_s, theirs_s = min(found["ours"]), min(found["diffusers"])
    print()
    print(
        f"Combined, {COMBINED_STEPS} steps, whole request (CPU-s, lowest of {ROUNDS}): ours "
        f"{COMBINED.name} (first_block 0.12) {ours_s:.2f} s, diffusers' eager float32 call "
        f"{theirs_s:.2f} s: {theirs_s / ours_s:.2f}x; decoded image PSNR "
        f"{psnr(images['ours'], images['diffusers'], 1.0):.1f} dB; our first request "
        f"{combined.first_s:.1f} s ({combined.first_cpu_s:.1f} CPU-s), inductor "
        f"{combined.compile_cell()}",
        flush=True,
    )


def warm_inductor() -> None:
    """Pay what inductor does once a process and cache folder before any setting compiles.

    Its first compile probes the CPU's vector instructions and builds its C++ support
    (measured: a one-line function took 106 s wall the first time, 8 s the second, on
    the loaded 2-core machine). Unpaid, it lands in the compile seconds and the first
    request of whichever library compiles first: always ours, which loads first.
    """
    torch.compile(torch.sin)(torch.zeros(8))


def main() -> None:
    """Print the acceleration tables on the smoothed Flux bench folder.

    Inductor's cache lives in the run's own folder: compile seconds are those of a first
    compile of each graph in this run, never one read back from an earlier run.
    """
    with tempfile.TemporaryDirectory() as root:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(root) / "inductor")
        torch._inductor.config.compile_threads = 1  # its compiles counted by cpu_seconds
        warm_inductor()
        folder = write_pipeline("flux", Path(root) / "flux", size="bench", smooth_time=True)
        try:
            step_table(folder)
            combined_table(folder)
        finally:
            for orchestrator in _held:
                orchestrator.close()


if __name__ == "__main__":
    main()
