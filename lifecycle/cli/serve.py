"""``lifecycle serve SPEC... [--host] [--port] [--threads] [--device-budget] [--worker]
[--api-key] [--admin-key]``: the HTTP worker's command.

The HTTP libraries are the optional ``serve`` extra: they are imported only when
the command runs, and their absence is bad input (exit 2) naming the extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from lifecycle.cli.cores import torch_threads
from lifecycle.cli.exits import ExitCode
from lifecycle.refusals import AdmissionRefused
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import load_spec, load_worker_file
from lifecycle.spec.structs import PipelineSpec

__all__ = ["serve_command"]

SERVE_LIBRARIES = ("fastapi", "uvicorn", "httptools", "uvloop", "prometheus_client")


def serve_command(args: argparse.Namespace) -> int:
    """Admit the pipelines, then serve them until SIGTERM or SIGINT drains them; the exit code.

    0 drained cleanly, 1 refused, 2 a bad spec, worker file, key or address (bound
    before anything is admitted or loaded), 3 jobs or components left when the drain
    timed out, or a pipeline failed to load.
    """
    missing = [name for name in SERVE_LIBRARIES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"lifecycle serve: {', '.join(missing)} not installed; install the serve extra: "
            "pip install 'pipeline-lifecycle[serve]'",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    from lifecycle.serving.auth import DoorKeys  # needs the serve extra
    from lifecycle.serving.server import listen, open_worker, serve

    try:
        keys = DoorKeys.from_options(args.api_key, args.admin_key)
    except ValueError as err:
        print(f"lifecycle serve: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    threads = torch_threads(args.threads, event_loop=True)
    # a line for a person when ready and when draining; JSON logs asked for carry it as events
    announce = None if args.log_format == "json" else sys.stderr
    specs = _read_specs(args.specs, args.download)
    if specs is None:
        return ExitCode.BAD_INPUT
    try:
        settings = None if args.worker is None else load_worker_file(args.worker)
    except ConfigError as err:
        print(f"lifecycle serve: {args.worker}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        listener = listen(args.host, args.port)
    except OSError as err:
        print(
            f"lifecycle serve: cannot listen on {args.host}:{args.port}: "
            f"{err.strerror or err}; pick another --port or --host, or stop what holds that one",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    with listener:
        try:
            worker = open_worker(specs, args.specs, threads.count, args.device_budget, settings)
        except AdmissionRefused as err:
            print(f"lifecycle serve: {err}", file=sys.stderr)  # every refusal, with its fix
            return ExitCode.REFUSED
        except ValueError as err:  # specs on different devices
            print(f"lifecycle serve: {err}", file=sys.stderr)
            return ExitCode.BAD_INPUT
        clean = serve(worker, listener, keys, announce, abandoned_exit=ExitCode.FAILED)
    return ExitCode.OK if clean else ExitCode.FAILED


def _read_specs(paths: Sequence[Path], download: bool) -> list[PipelineSpec] | None:
    """Decode every spec (``download``: model ids may be fetched); print what is wrong (a bad
    spec, two of one name) and return None."""
    specs = []
    for path in paths:
        try:
            specs.append(load_spec(path, download=download))
        except ConfigError as err:
            print(f"lifecycle serve: {path}: {err}", file=sys.stderr)
            return None
    names = [spec.name for spec in specs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        print(
            f"lifecycle serve: two specs name the pipeline {', '.join(map(repr, twice))}; "
            "requests pick a pipeline by name: give each its own name",
            file=sys.stderr,
        )
        return None
    return specs
