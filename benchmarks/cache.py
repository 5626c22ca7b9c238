"""Step caches (design §17): ours against diffusers' and cache-dit's on the same Flux folder.

A ``--size bench`` Flux folder (transformer of 8 double + 8 single blocks, width 384) written
with a smoothed time embedding (``make_pipeline --smooth-time``: adjacent steps differ as a
trained model's do; on seeded weights no cache skips anything). One request, 256x256, 28
steps, seed 0, on one thread. Side by side in one run, each library against its own
uncached request:

- **ours**: the orchestrator with ``[components.transformer.cache]`` (first_block at several
  thresholds, taylor_seer at several intervals; warm-up 2 and final 1, the defaults);
- **diffusers**: its own ``FluxPipeline`` with ``transformer.enable_cache`` of
  ``FirstBlockCacheConfig`` (same thresholds) and ``TaylorSeerCacheConfig`` (same intervals,
  caching after the same warm-up, float32 factors);
- **cache-dit** (``[bench]`` extra): ``cache_dit.enable_cache`` with ``DBCacheConfig(
  Fn_compute_blocks=1, Bn_compute_blocks=0)`` (its first-block cache; its default F8B0
  needs 9 blocks or more) at the same thresholds and the same warm-up.

Per setting, the lowest of 3 rounds in which every setting of every library runs once in
turn: CPU-seconds per request (encode, denoise, decode), the speed-up over that
library's uncached request, the steps whose remaining blocks ran, and the PSNR of the final
latents (peak: the uncached latents' range) and of the decoded image ([0, 1]) against that
library's uncached request (the two uncached outputs agree within 1e-5), and the speed-up
over our uncached request (the libraries' own uncached requests differ in speed). Ours also
runs first_block with diffusers' schedule (no warm-up beyond the first step, no final
step), which makes its decisions. Then, at matched error, each library's fastest setting
with its latents at or above 50, 45 and 40 dB. Last, ours under layerwise offload: the
block bytes streamed per request, uncached and cached.

Run: ``python -m benchmarks cache``.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from benchmarks.folders import load_diffusers
from benchmarks.make_pipeline import write_pipeline
from components.batch import Batch
from components.libraries import is_importable
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec

STEPS = 28
SIZE = (256, 256)
PROMPT = "a red fox leaps over the snow at dawn, golden light"
GUIDANCE = 3.5
ROUNDS = 3
THRESHOLDS = (0.05, 0.08, 0.12, 0.2, 0.3)
INTERVALS = (3, 4, 6, 8)
WARMUP = 2
MATCHED_PSNR = (50.0, 45.0, 40.0)
"""The latents PSNRs (dB) at which the libraries are compared, each at its fastest setting
at or above it."""
EAGER = (0.2, 0.3)
"""Thresholds ours also runs with diffusers' schedule (no warm-up beyond the first step, no
final step): the same decisions as its FirstBlockCache."""
KEPT_HEAD = "[components.transformer.layerwise]\nresident_layers = 1\nprefetch = 0\n"
"""Layerwise settings that keep the first block on the device and prefetch none, so that a
step first_block skips streams no block at all."""
LAYERWISE = (
    ("uncached", "", ""),
    ("first_block 0.08", 'method = "first_block"', ""),
    ("taylor_seer interval 4", 'method = "taylor_seer"', ""),
    ("uncached, first block kept, no prefetch", "", KEPT_HEAD),
    ("first_block 0.08, first block kept, no prefetch", 'method = "first_block"', KEPT_HEAD),
)
"""Our layerwise runs: name, cache table, layerwise table."""


class Outcome(NamedTuple):
    """One request under one setting.

    Attributes:
        seconds: CPU-seconds of the request (the lowest of ``ROUNDS``).
        computed: steps whose remaining blocks ran.
        latents: the final latents.
        image: the decoded image in [0, 1].
    """

    seconds: float
    computed: int
    latents: torch.Tensor
    image: torch.Tensor


Request = Callable[[], tuple[int, torch.Tensor, torch.Tensor]]
"""Runs one request: the steps whose remaining blocks ran, the final latents, the image."""


class Setting(NamedTuple):
    """One library's request under one cache setting.

    Attributes:
        library: ours, diffusers or cache-dit.
        name: the setting, ``uncached`` for the library's own baseline.
        run: runs one request.
        enable: sets the library's cache up before the request (none for ours).
        disable: takes it down after.
    """

    library: str
    name: str
    run: Request
    enable: Callable[[], object] = lambda: None
    disable: Callable[[], object] = lambda: None


def psnr(ours: torch.Tensor, reference: torch.Tensor, peak: float) -> float:
    """Return the PSNR of ``ours`` against ``reference`` in dB for a signal of ``peak``."""
    mse = float(((ours.double() - reference.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def interleaved(settings: list[Setting]) -> list[Outcome]:
    """Run every setting once a round for ``ROUNDS`` rounds, the order reversed every other
    round; each one's lowest CPU-seconds, with its last outputs."""
    seconds: list[list[float]] = [[] for _ in settings]
    outputs: list[tuple[int, torch.Tensor, torch.Tensor]] = [(0, torch.empty(0), torch.empty(0))]
    outputs *= len(settings)
    order = list(range(len(settings)))
    for round_ in range(ROUNDS):
        for i in order if round_ % 2 == 0 else reversed(order):
            setting = settings[i]
            setting.enable()
            started = time.process_time()
            outputs[i] = setting.run()
            seconds[i].append(time.process_time() - started)
            setting.disable()
    return [Outcome(min(times), *found) for times, found in zip(seconds, outputs, strict=True)]


def ours(
    folder: Path, cache: str, residency: str = "", tables: str = ""
) -> tuple[Orchestrator, Request]:
    """Load ``folder`` through the orchestrator with ``cache`` (a cache table's body, or none),
    ``residency`` for its transformer and more ``tables``; the orchestrator and a request."""
    text = f'source = "{folder}"\ndevice = "cpu"\n'
    if residency:
        text += f'[components.transformer]\nresidency = "{residency}"\n'
    text += tables
    if cache:
        text += f"[components.transformer.cache]\n{cache}\n"
    orchestrator = Orchestrator(decode_spec(text))
    orchestrator.admit()
    orchestrator.load()

    def run() -> tuple[int, torch.Tensor, torch.Tensor]:
        batch = Batch(
            generator=torch.Generator("cpu").manual_seed(0),
            steps=STEPS,
            prompts=[PROMPT],
            guidance_scale=GUIDANCE,
            image_size=SIZE,
        )
        with orchestrator.request() as request:
            request.run("encode", batch)
            request.run("denoise", batch)
            latents = torch.stack(list(batch.latents or []))
            request.run("decode", batch)
        rows = batch.cache_rows
        computed = STEPS if rows is None or rows[0] is None else rows[0].computed
        assert isinstance(batch.images, torch.Tensor)
        return computed, latents, (batch.images / 2 + 0.5).clamp(0, 1)

    return orchestrator, run


def theirs(pipeline: Any) -> Request:
    """Return a request through diffusers' pipeline as it is set up then (latents, then the
    image decoded from them), counting the steps its last block's attention ran."""
    calls = [0]
    last = pipeline.transformer.single_transformer_blocks[-1].attn.to_q
    last.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def run() -> tuple[int, torch.Tensor, torch.Tensor]:
        calls[0] = 0
        latents = pipeline(
            PROMPT,
            generator=torch.Generator("cpu").manual_seed(0),
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            height=SIZE[0],
            width=SIZE[1],
            output_type="latent",
        ).images
        computed = calls[0]
        image = decode(pipeline, latents)
        return computed, latents, image

    return run


def decode(pipeline: Any, latents: torch.Tensor) -> torch.Tensor:
    """Decode Flux's packed latents as its pipeline does; the image in [0, 1]."""
    unpacked = pipeline._unpack_latents(latents, SIZE[0], SIZE[1], pipeline.vae_scale_factor)
    config = pipeline.vae.config
    unpacked = unpacked / config.scaling_factor + config.shift_factor
    with torch.inference_mode():
        image = pipeline.vae.decode(unpacked, return_dict=False)[0]
    return (image / 2 + 0.5).clamp(0, 1)


def row(setting: Setting, outcome: Outcome, base: Outcome, ours: Outcome) -> dict[str, Any]:
    """Return one table row of ``outcome`` against its library's uncached ``base`` (and the
    speed-up over ``ours``, our uncached request)."""
    peak = float(base.latents.max() - base.latents.min())
    return {
        "library": setting.library,
        "setting": setting.name,
        "seconds": outcome.seconds,
        "speedup": base.seconds / outcome.seconds,
        "over_ours": ours.seconds / outcome.seconds,
        "computed": outcome.computed,
        "latents": psnr(outcome.latents.flatten(), base.latents.flatten(), peak),
        "image": psnr(outcome.image, base.image, 1.0),
    }


def ours_settings(folder: Path, held: list[Orchestrator]) -> list[Setting]:
    """Our settings, each on an orchestrator of its own (kept in ``held``)."""
    tables = [("uncached", "")]
    tables += [
        (f"first_block {t:g}", f'method = "first_block"\nthreshold = {t}') for t in THRESHOLDS
    ]
    tables += [
        (
            f"first_block {t:g}, warmup 1, final 0",
            f'method = "first_block"\nthreshold = {t}\nwarmup_steps = 1\nfinal_steps = 0',
        )
        for t in EAGER
    ]
    tables += [
        (f"taylor_seer interval {k}", f'method = "taylor_seer"\ninterval = {k}') for k in INTERVALS
    ]
    settings = []
    for name, table in tables:
        orchestrator, run = ours(folder, table)
        held.append(orchestrator)
        settings.append(Setting("ours", name, run))
    return settings


def diffusers_settings(folder: Path) -> list[Setting]:
    """diffusers' caches on its own FluxPipeline, enabled for their turn and disabled after."""
    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

    pipeline = load_diffusers(folder)
    run = theirs(pipeline)
    transformer = pipeline.transformer
    configs: list[tuple[str, Any]] = [
        (f"FirstBlockCache {t:g}", FirstBlockCacheConfig(threshold=t)) for t in THRESHOLDS
    ]
    configs += [
        (
            f"TaylorSeer interval {k}",
            TaylorSeerCacheConfig(
                cache_interval=k,
                disable_cache_before_step=WARMUP,
                max_order=1,
                taylor_factors_dtype=torch.float32,
            ),
        )
        for k in INTERVALS
    ]
    settings = [Setting("diffusers", "uncached", run)]
    settings += [
        Setting(
            "diffusers",
            name,
            run,
            partial(transformer.enable_cache, config),
            transformer.disable_cache,
        )
        for name, config in configs
    ]
    return settings


def cache_dit_settings(folder: Path) -> list[Setting]:
    """cache-dit's first-block DBCache (F1B0) on a FluxPipeline of its own."""
    import cache_dit

    pipeline = load_diffusers(folder)
    run = theirs(pipeline)
    settings = [Setting("cache-dit", "uncached", run)]
    for threshold in THRESHOLDS:
        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1,
            Bn_compute_blocks=0,
            residual_diff_threshold=threshold,
            max_warmup_steps=WARMUP,
        )
        settings.append(
            Setting(
                "cache-dit",
                f"DBCache F1B0 {threshold:g}",
                run,
                partial(cache_dit.enable_cache, pipeline, cache_config=config),
                partial(cache_dit.disable_cache, pipeline),
            )
        )
    return settings


def measure(folder: Path) -> list[dict[str, Any]]:
    """Run every library's settings side by side; one row per setting."""
    held: list[Orchestrator] = []
    settings = ours_settings(folder, held)
    if is_importable("diffusers"):
        settings += diffusers_settings(folder)
    if is_importable("cache_dit"):
        settings += cache_dit_settings(folder)
    try:
        outcomes = interleaved(settings)
    finally:
        for orchestrator in held:
            orchestrator.close()
    bases = {s.library: o for s, o in zip(settings, outcomes, strict=True) if s.name == "uncached"}
    return [
        row(setting, outcome, bases[setting.library], bases["ours"])
        for setting, outcome in zip(settings, outcomes, strict=True)
    ]


def streamed_rows(folder: Path) -> list[tuple[str, int, int]]:
    """Return our block bytes streamed per request under layerwise offload, and the steps
    computed, for each of ``LAYERWISE``."""
    found = []
    for name, cache, layerwise in LAYERWISE:
        orchestrator, run = ours(folder, cache, "layerwise_offload", layerwise)
        events: list[Event] = []
        orchestrator.observe(events.append)
        with orchestrator:
            computed, _, _ = run()
        streamed = sum(e.streamed for e in events if isinstance(e, Move))
        found.append((name, streamed, computed))
    return found


def print_streamed(found: list[tuple[str, int, int]]) -> None:
    """Print the layerwise table: bytes streamed per request against the uncached request of
    the same layerwise settings."""
    print()
    print("Layerwise offload (prefetch 1 unless said), block bytes streamed per request:")
    print()
    print("| setting | MiB streamed | / uncached alike | steps computed / steps |")
    print("|---|---:|---:|---:|")
    uncached = {
        layerwise: streamed
        for (name, streamed, _), (_, cache, layerwise) in zip(found, LAYERWISE, strict=True)
        if not cache
    }
    for (name, streamed, computed), (_, _, layerwise) in zip(found, LAYERWISE, strict=True):
        ratio = streamed / uncached[layerwise]
        print(f"| {name} | {streamed / 2**20:.1f} | {ratio:.3f} | {computed / STEPS:.3f} |")


def print_rows(rows: list[dict[str, Any]]) -> None:
    """Print the table of every setting, then each library at matched error."""
    print(
        "| library | setting | CPU-s / request | speed-up | over ours uncached "
        "| steps computed | PSNR latents dB | PSNR image dB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['library']} | {r['setting']} | {r['seconds']:.2f} | {r['speedup']:.2f}x "
            f"| {r['over_ours']:.2f}x | {r['computed']}/{STEPS} | {r['latents']:.1f} "
            f"| {r['image']:.1f} |"
        )
    print()
    print("At matched error, each library's fastest setting with its latents at or above:")
    print()
    libraries = list(dict.fromkeys(r["library"] for r in rows))
    print("| latents PSNR | " + " | ".join(libraries) + " |")
    print("|---|" + "---|" * len(libraries))
    for target in MATCHED_PSNR:
        cells = []
        for library in libraries:
            good = [r for r in rows if r["library"] == library and r["latents"] >= target]
            best = max(good, key=lambda r: r["speedup"])
            cells.append(
                f"{best['setting']}: {best['speedup']:.2f}x ({best['over_ours']:.2f}x over "
                f"ours uncached), {best['latents']:.1f} dB"
            )
        print(f"| >= {target:g} dB | " + " | ".join(cells) + " |")


def main() -> None:
    """Print the step cache table on the smoothed Flux bench folder."""
    with tempfile.TemporaryDirectory() as root:
        folder = write_pipeline("flux", Path(root) / "flux", size="bench", smooth_time=True)
        rows = measure(folder)
        print(
            f"### Step caches (Flux bench folder, smoothed time embedding, {SIZE[0]}x{SIZE[1]}, "
            f"{STEPS} steps, lowest of {ROUNDS} interleaved rounds)"
        )
        print()
        print_rows(rows)
        print_streamed(streamed_rows(folder))


if __name__ == "__main__":
    main()
