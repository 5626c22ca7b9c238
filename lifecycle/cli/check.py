"""``lifecycle check SPEC... [--json] [--device-budget] [--worker]``: admission's dry run.

Every spec is admitted without loading anything; several (or a worker budget) are
admitted as one worker serves them, under one device budget.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from msgspec import UnsetType

from lifecycle.cli.console import (
    ACCELERATION_HEADINGS,
    fallback_legend,
    format_refusals,
    is_accelerated,
    table,
)
from lifecycle.cli.exits import ExitCode
from lifecycle.cli.output import print_json
from lifecycle.device.shared import SharedDevice, worker_budget
from lifecycle.orchestrator import Orchestrator
from lifecycle.plan import PipelineSnapshot, SitePlan
from lifecycle.refusals import AdmissionRefused
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.model_ids import parse_model_id, snapshot_folder
from lifecycle.spec.reading import load_spec, load_worker_file
from lifecycle.spec.sizes import format_bytes
from lifecycle.spec.structs import PipelineSpec

__all__ = ["check_command"]


def check_command(args: argparse.Namespace) -> int:
    """Admit every spec; several (or a worker budget) as one worker serves them."""
    try:
        specs = [load_spec(path, download=args.download) for path in args.specs]
        settings = None if args.worker is None else load_worker_file(args.worker)
    except ConfigError as err:
        if args.json:
            print_json({"error": {"path": err.path, "message": err.message}})
        else:
            print(f"lifecycle check: {err.source}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    shared = None
    if len(specs) > 1 or args.device_budget is not None or settings is not None:
        limit, key = worker_budget(specs, args.device_budget, settings)
        shared = SharedDevice(device_budget=limit, budget_key=key)
    try:
        orchestrators = [Orchestrator(spec, shared=shared) for spec in specs]
    except ValueError as err:  # specs on different devices
        print(f"lifecycle check: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    for orchestrator in orchestrators:
        with contextlib.suppress(AdmissionRefused):
            orchestrator.admit()
    snapshots = [orchestrator.snapshot() for orchestrator in orchestrators]
    admitted = all(snapshot.admitted for snapshot in snapshots)
    if args.json:
        if len(snapshots) == 1:
            print_json(snapshots[0])
        else:
            budget = None if shared is None else shared.budget.limit
            print_json({"admitted": admitted, "device_budget": budget, "pipelines": snapshots})
    else:
        for spec, snapshot, orchestrator in zip(specs, snapshots, orchestrators, strict=True):
            if snapshot.refusals:
                print(format_refusals("check", spec.name, snapshot.refusals, spec.components))
            else:
                print(_summary(spec, snapshot, orchestrator.platform.kind))
    return ExitCode.OK if admitted else ExitCode.REFUSED


def _summary(spec: PipelineSpec, snapshot: PipelineSnapshot, platform: str) -> str:
    head = (
        f"pipeline {spec.name!r}: admitted ({len(spec.components)} components, "
        f"{len(spec.stages)} stages, platform {platform})"
    )
    rows: list[tuple[str, ...]] = [
        ("component", "kind", "loader", "size", "residency", "attention")
    ]
    caches = any(component.cache is not None for component in snapshot.components.values())
    if caches:
        rows[0] += ("cache",)
    accelerated = is_accelerated(snapshot.components.values())
    if accelerated:
        rows[0] += ACCELERATION_HEADINGS
    for name, component in snapshot.components.items():
        explicit = not isinstance(spec.components[name].residency, UnsetType)
        rows.append(
            (
                name,
                component.kind,
                component.loader or "-",
                "-" if component.bytes is None else format_bytes(component.bytes),
                component.residency.value + (" (explicit)" if explicit else ""),
                ", ".join(_site_text(site) for site in component.attention) or "-",
            )
        )
        if caches:
            rows[-1] += ("-" if component.cache is None else component.cache.describe(),)
        if accelerated:
            rows[-1] += (component.compile, component.quantization)
    adapters: list[tuple[str, ...]] = [("adapter", "component", "mode", "scale", "path")]
    adapters += [(a.name, a.component, a.mode, f"{a.scale:g}", a.path) for a in snapshot.adapters]
    timeline = " -> ".join(stage.describe() for stage in spec.stages)
    source = [] if snapshot.source is None else [f"  source: {_source_text(snapshot)}"]
    reasons = {site.reason for c in snapshot.components.values() for site in c.attention}
    return "\n".join(
        [
            head,
            *table(rows),
            *(table(adapters) if snapshot.adapters else ()),
            f"  stages: {timeline or '(none)'}",
            *source,
            *fallback_legend(reasons),
        ]
    )


def _source_text(snapshot: PipelineSnapshot) -> str:
    """Say where the pipeline's folder is: its path, or its model id's revision and folder."""
    model_id = None if snapshot.source is None else parse_model_id(snapshot.source)
    if model_id is None:
        return str(snapshot.source)
    return f"{model_id.repo} at revision {snapshot.revision} ({snapshot_folder(model_id)})"


def _site_text(site: SitePlan) -> str:
    text = f"{site.site}={site.backend} ({site.provenance.value}"
    return text + (f", {site.reason})" if site.reason else ")")
