"""What the ``lifecycle`` command prints for a person: tables, refusals, run summaries."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from attention import DENSE_CROSS_FALLBACK, GLOBAL_BACKEND_FALLBACK, PLATFORM_DEFAULT_FALLBACK
from components.cache import CacheSteps
from lifecycle.plan import RefusalReport
from lifecycle.refusals import Refusal
from lifecycle.spec.sizes import format_bytes

if TYPE_CHECKING:  # a run's report, made by the runner: check and diagram import none of it
    from lifecycle.cli.runner import RunReport

__all__ = [
    "ACCELERATION_HEADINGS",
    "fallback_legend",
    "format_refusals",
    "is_accelerated",
    "run_summary",
    "table",
]

PIPELINE_COLUMN = "(pipeline)"
"""The component column of a refusal about the whole pipeline (a layout, a stage)."""

FALLBACK_MEANINGS = {
    PLATFORM_DEFAULT_FALLBACK: "no backend was named for the site explicitly, and the first "
    "choice (its layer's default, else the platform's) cannot serve what the site needs, so "
    "the next one the platform prefers that can serves it; expected, not an error (set "
    "attention_backend to choose)",
    GLOBAL_BACKEND_FALLBACK: "attention.backend cannot serve the site, and its component may "
    "fall back (a text encoder, a VAE, a layer with a default of its own), so another does",
    DENSE_CROSS_FALLBACK: "a sparse backend never serves cross-attention, so a dense one does",
}
"""What each reason a site's backend was not the one asked for means (design §4.2)."""


def fallback_legend(reasons: Collection[str | None]) -> list[str]:
    """Return a line saying what each fallback reason among ``reasons`` means, in order."""
    return [
        f"  {reason}: {meaning}"
        for reason, meaning in FALLBACK_MEANINGS.items()
        if reason in reasons
    ]


ACCELERATION_HEADINGS = ("compile", "quantization")
"""The columns a table of components adds when one of them is compiled or quantized."""


class Accelerated(Protocol):
    """A component as a table row sees it: how it is compiled and quantized."""

    @property
    def compile(self) -> str: ...

    @property
    def quantization(self) -> str: ...


def is_accelerated(components: Iterable[Accelerated]) -> bool:
    """Say whether any of ``components`` is compiled or quantized (the table then shows how)."""
    return any(c.compile != "off" or c.quantization != "off" for c in components)


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Return ``rows`` as aligned, indented lines; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def format_refusals(
    command: str,
    pipeline: str,
    refusals: Sequence[Refusal | RefusalReport],
    components: Collection[str],
) -> str:
    """Return refusals the way a person reads them: what, then how to fix it.

    Args:
        command: the subcommand that was refused (``check``, ``run``).
        pipeline: the pipeline's name.
        refusals: every reason.
        components: the pipeline's components; a refusal about the pipeline's name that
            names none of them is about the whole pipeline and shows ``(pipeline)`` (one
            about a component a folder has and refuses shows that component).
    """
    count = len(refusals)
    names = [
        PIPELINE_COLUMN
        if r.component == pipeline and r.component not in components
        else r.component
        for r in refusals
    ]
    lines = [
        f"lifecycle {command}: pipeline {pipeline!r} refused ({count} reason{'s' * (count != 1)})"
    ]
    name_width = max(map(len, names))
    code_width = max(len(r.code) for r in refusals)
    for name, r in zip(names, refusals, strict=True):
        lines.append(f"  {name.ljust(name_width)}  {r.code.ljust(code_width)}  {r.message}")
        lines.append(f"  {' ' * name_width}  fix: {r.hint}")
    return "\n".join(lines)


def run_summary(report: RunReport) -> str:
    """Return a run's summary: request times, each component's moves, the results."""
    times = sorted(report.request_ms)
    head = (
        f"pipeline {report.pipeline!r}: {report.requests} request{'s' * (report.requests != 1)} "
        f"x {report.steps} step{'s' * (report.steps != 1)} "
        f"on {report.threads} thread{'s' * (report.threads != 1)} ({report.threads_reason})"
    )
    if times:
        head += (
            f", median {times[len(times) // 2]:.1f} ms per request (min {times[0]:.1f}, "
            f"max {times[-1]:.1f})"
        )
    if report.stopped_by is not None:
        head += f"; stopped by {report.stopped_by}"
    caches = any(c.cache is not None for c in report.components.values())
    accelerated = is_accelerated(report.components.values())
    rows: list[tuple[str, ...]] = [
        ("component", "state", "size", "onloads", "offloads", "moved", "move time", "attention")
        + (("cache",) if caches else ())
        + (ACCELERATION_HEADINGS if accelerated else ())
    ]
    rows += [
        (
            name,
            c.state,
            "-" if c.bytes is None else format_bytes(c.bytes),
            str(c.onloads),
            str(c.offloads),
            format_bytes(c.bytes_moved),
            f"{c.move_seconds * 1e3:.1f} ms",
            ", ".join(c.backends) or "-",
        )
        + ((_cache_text(c.cache),) if caches else ())
        + ((c.compile, c.quantization) if accelerated else ())
        for name, c in report.components.items()
    ]
    lines = [head, *table(rows)]
    if report.neighbours:
        lines.append("  nearest neighbour of each sentence (cosine similarity):")
        lines += table(
            [
                ("sentence", "neighbour", "cosine"),
                *((n.sentence, n.neighbour, f"{n.cosine:.3f}") for n in report.neighbours),
            ]
        )
    if report.prompt_cache is not None:
        hits, misses = report.prompt_cache.hits, report.prompt_cache.misses
        lines.append(f"  prompt cache: {hits} prompts cached, {misses} encoded")
    if report.images:
        count = len(report.images)
        folder = Path(report.images[0]).parent
        lines.append(f"  images: {count} PNG file{'s' * (count != 1)} written to {folder}")
    if report.videos:
        count = len(report.videos)
        first = Path(report.videos[0])
        s = "s" * (count != 1)
        what = f"{first.suffix[1:].upper()} file{s}" if first.suffix else f"folder{s} of PNG frames"
        lines.append(f"  videos: {count} {what} written to {first.parent}")
    return "\n".join(lines)


def _cache_text(steps: CacheSteps | None) -> str:
    """Return a step cache's steps for the summary: ``12 computed, 16 skipped``."""
    if steps is None:
        return "-"
    uncached = f" ({steps.uncached} rows uncached: too few steps)" if steps.uncached else ""
    return f"{steps.computed} computed, {steps.skipped} skipped{uncached}"
