"""``acceleration = "auto"``: choose what a spec left open, by measuring it (design §17).

The seed rule: an explicit choice is honoured, an automatic one may be chosen. For every
component whose ``compile`` or ``quantization`` the spec does not set, the candidates
the platform admits are measured before the pipeline serves: compile ``off`` or
``blocks``, quantization ``off`` or ``int8_dynamic``. Each candidate runs in a pipeline
of its own (loaded, one request to warm and compile it, then two timed ones), one
component at a time, the others as in the untuned pipeline; a candidate whose output
falls below ``acceleration_min_psnr`` against the untuned pipeline's is dropped. The
fastest stays: the tuned spec carries it, and ``acceleration.selected`` says so with
provenance ``autotuned``, the measured ratio and every candidate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from itertools import product

import msgspec
import torch
from msgspec import UnsetType

from attention import Platform
from components.batch import Batch
from components.compile import CompileMode
from components.quantize import Quantization
from lifecycle.admission import admit_pipeline
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator, platform_for
from lifecycle.spec.structs import PipelineSpec

__all__ = ["tune"]

log = get_logger("lifecycle")

COMPILE_CANDIDATES: tuple[CompileMode, ...] = ("off", "blocks")
QUANTIZATION_CANDIDATES: tuple[Quantization, ...] = ("off", "int8_dynamic")
PROBE_STEPS = 2
TIMED_REQUESTS = 2
"""Requests timed per candidate after the one that warms (and compiles) it: the fastest
counts, so a busy moment of the machine does not choose."""


class Trial(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One candidate measured for one component.

    Attributes:
        compile: its compile mode.
        quantization: its quantization.
        seconds: the component's stages in one probe request (the fastest timed one);
            None when it was not run.
        psnr: the PSNR (dB) of the probe's output against the untuned pipeline's.
        refused: why admission refused it here, or why it was dropped; None when it ran
            and kept the PSNR floor.
    """

    compile: CompileMode
    quantization: Quantization
    seconds: float | None = None
    psnr: float | None = None
    refused: str | None = None


class Selected(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What tuning chose for one component (the ``acceleration.selected`` event).

    Attributes:
        component: the component.
        compile: the compile mode it runs (explicit ones stay as written).
        quantization: the quantization it runs.
        ratio: the untuned candidate's seconds over the chosen one's (above 1: faster).
        candidates: every candidate, measured or refused.
        provenance: always ``autotuned``.
    """

    component: str
    compile: CompileMode
    quantization: Quantization
    ratio: float
    candidates: tuple[Trial, ...]
    provenance: str = "autotuned"


def tune(
    spec: PipelineSpec, platform: Platform | None = None
) -> tuple[PipelineSpec, list[Selected]]:
    """Return ``spec`` with what ``acceleration = "auto"`` chose for its open keys, and why.

    A spec without ``acceleration = "auto"`` comes back unchanged; so does one whose
    components set both keys each (``acceleration.untuned`` says so).
    """
    if spec.acceleration != "auto":
        return spec, []
    open_keys = {
        name: (isinstance(c.compile, UnsetType), isinstance(c.quantization, UnsetType))
        for name, c in spec.components.items()
    }
    open_keys = {name: keys for name, keys in open_keys.items() if any(keys)}
    platform = platform or platform_for(spec)
    # an open key is off until chosen; an explicit one is what the spec says, throughout
    chosen = {
        name: (spec.components[name].compile_mode, spec.components[name].quantization_mode)
        for name in open_keys
    }
    untuned = _with(spec, chosen)
    reason = _untuned_reason(untuned, open_keys, platform)
    if reason is not None:
        log.info("acceleration.untuned", pipeline=spec.name, reason=reason)
        return spec, []
    base_seconds, base_output = _probe(untuned, platform)
    selections = []
    for name, (compile_open, quantization_open) in open_keys.items():
        mode, quantization = chosen[name]
        trials = [Trial(compile=mode, quantization=quantization, seconds=base_seconds[name])]
        for mode, quantization in _candidates(*chosen[name], compile_open, quantization_open):
            trials.append(_trial(untuned, name, mode, quantization, platform, base_output))
        kept = [t for t in trials if t.refused is None and t.seconds is not None]
        best = min(kept, key=lambda t: t.seconds or math.inf)
        chosen[name] = (best.compile, best.quantization)
        ratio = base_seconds[name] / best.seconds if best.seconds else 1.0
        selected = Selected(
            component=name,
            compile=best.compile,
            quantization=best.quantization,
            ratio=round(ratio, 3),
            candidates=tuple(trials),
        )
        log.info("acceleration.selected", pipeline=spec.name, **msgspec.to_builtins(selected))
        selections.append(selected)
    return _with(spec, chosen), selections


def _untuned_reason(
    untuned: PipelineSpec, open_keys: Mapping[str, tuple[bool, bool]], platform: Platform
) -> str | None:
    """Say why nothing is tuned, or None when the open keys can be measured."""
    if not open_keys:
        return "every component sets compile and quantization: nothing is left to tune"
    if untuned.parallel.world_size != 1:
        return "a parallel layout runs the pipeline on several ranks: tuning measures one process"
    if not admit_pipeline(untuned, platform).admitted:
        return "the pipeline is refused as it is (admission says why)"
    return None


def _candidates(
    compile_mode: CompileMode,
    quantization: Quantization,
    compile_open: bool,
    quantization_open: bool,
) -> Iterator[tuple[CompileMode, Quantization]]:
    """Yield each candidate but the untuned one (``compile_mode``, ``quantization``): open
    keys vary, explicit ones stay."""
    modes = COMPILE_CANDIDATES if compile_open else (compile_mode,)
    quantizations = QUANTIZATION_CANDIDATES if quantization_open else (quantization,)
    for candidate in product(modes, quantizations):
        if candidate != (compile_mode, quantization):
            yield candidate


def _trial(
    untuned: PipelineSpec,
    name: str,
    mode: CompileMode,
    quantization: Quantization,
    platform: Platform,
    reference: torch.Tensor,
) -> Trial:
    """Measure one candidate for component ``name``, the others untuned."""
    spec = _with(untuned, {name: (mode, quantization)})
    admission = admit_pipeline(spec, platform)
    refusals = [r for r in admission.refusals() if r.component == name]
    if refusals:
        return Trial(
            compile=mode,
            quantization=quantization,
            refused=f"{refusals[0].code}: {refusals[0].message}",
        )
    seconds, output = _probe(spec, platform)
    quality = _psnr(output, reference)
    floor = untuned.acceleration_min_psnr
    return Trial(
        compile=mode,
        quantization=quantization,
        seconds=seconds[name],
        psnr=round(quality, 2),
        refused=None if quality >= floor else f"PSNR {quality:.1f} dB is below {floor:g} dB",
    )


def _probe(spec: PipelineSpec, platform: Platform) -> tuple[dict[str, float], torch.Tensor]:
    """Load ``spec`` and run the probe requests; return each component's stage seconds in
    the fastest timed request, and that request's output."""
    fastest: dict[str, float] = {}
    output = torch.empty(0)
    with Orchestrator(spec, platform=platform) as pipeline:
        pipeline.admit()
        pipeline.load()
        for number in range(1 + TIMED_REQUESTS):
            seconds, output = _request(pipeline, f"probe-{number}")
            if number == 0:
                continue  # warms, and compiles what is compiled
            for name, taken in seconds.items():
                fastest[name] = min(fastest.get(name, math.inf), taken)
    return fastest, output


def _request(pipeline: Orchestrator, request_id: str) -> tuple[dict[str, float], torch.Tensor]:
    """Run one seeded probe request through every stage, timing each component's stages."""
    recipe = pipeline.recipe
    batch = Batch(
        generator=torch.Generator().manual_seed(0),
        steps=PROBE_STEPS,
        prompts=["a probe of the pipeline"],
        image_size=None if recipe is None else (recipe.multiple * 4, recipe.multiple * 4),
    )
    seconds = dict.fromkeys(pipeline.spec.components, 0.0)
    with pipeline.request(request_id) as request:
        for stage in pipeline.spec.stages:
            started = time.perf_counter()
            request.run(stage.name, batch)
            taken = time.perf_counter() - started
            for name in stage.uses:
                seconds[name] += taken
    return seconds, _output(batch)


def _output(batch: Batch) -> torch.Tensor:
    """Return what the probe produced last: its images, else its latents or embeddings."""
    images = batch.images
    if isinstance(images, list):
        return torch.cat([image.flatten() for image in images])
    if images is not None:
        return images
    if batch.latents is not None:
        return torch.cat([latent.flatten() for latent in batch.latents])
    if batch.sentence_embeddings is not None:
        return batch.sentence_embeddings
    return torch.cat([context.flatten() for context in batch.context or []])


def _psnr(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Return the PSNR (dB) of ``ours`` against ``reference``, over the reference's range."""
    mse = float(((ours.double() - reference.double()) ** 2).mean())
    peak = float(reference.max() - reference.min()) or 1.0
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def _with(
    spec: PipelineSpec, settings: dict[str, tuple[CompileMode, Quantization]]
) -> PipelineSpec:
    """Return ``spec`` with each named component's compile and quantization set."""
    components = dict(spec.components)
    for name, (mode, quantization) in settings.items():
        components[name] = msgspec.structs.replace(
            components[name], compile=mode, quantization=quantization
        )
    return msgspec.structs.replace(spec, components=components)
