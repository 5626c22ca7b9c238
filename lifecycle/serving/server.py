"""Run the worker under uvicorn; SIGTERM drains it, SIGHUP reloads every spec (needs the
``serve`` extra).

The drain handler is installed before the pipelines start loading, so a signal that
arrives while they load drains them too (once loaded: nothing is left behind, exit 0).
A signal that arrives earlier, while Python still imports the command, ends the
process the default way (exit 143): nothing is loaded then.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import torch
import uvicorn

from lifecycle.config import ConfigError, PipelineSpec, load_spec, load_worker_file
from lifecycle.exits import ExitCode
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused
from lifecycle.serving import changes
from lifecycle.serving.app import create_app
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Phase, Worker
from lifecycle.shared_device import SharedDevice, worker_budget

log = get_logger("lifecycle")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM or SIGINT drains the worker before exiting.

    While draining it keeps answering (new jobs get 503); once the queued and running
    jobs are done and everything is released, it stops. A second signal forces the exit.

    Args:
        config: uvicorn's settings.
        worker: the worker to drain.
    """

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker
        self.drained = False
        self._signal = signal.SIGTERM
        self._signalled = threading.Event()
        # started now, not by the handler: a signal handler may interrupt the main thread
        # inside a lock (a log write, a thread start) and must take none of its own
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start draining on the first signal; force the exit on the next."""
        if self._signalled.is_set():
            self.force_exit = True
            self.should_exit = True
            return
        self._signal = signal.Signals(sig)
        self._signalled.set()

    def _drain(self) -> None:
        self._signalled.wait()
        log.info("serving.draining", signal=self._signal.name)
        self.drained = self.worker.drain()
        self.should_exit = True


class Reloader:
    """Reload every spec on SIGHUP, on a thread of its own (``changes.reload_all``).

    The handler only sets an event: a signal may interrupt the main thread inside a
    lock, and reloading takes several. Signals that arrive during a reload make one
    more after it.

    Args:
        worker: the worker whose specs are reloaded.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._asked = threading.Event()
        threading.Thread(target=self._reload, name="reload", daemon=True).start()

    def handle(self, sig: int, frame: FrameType | None) -> None:
        """Ask for a reload of every spec."""
        self._asked.set()

    def _reload(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            if self.worker.phase is Phase.READY:
                log.info("serving.reloading", signal="SIGHUP")
                changes.reload_all(self.worker)


def serve(
    spec_paths: Sequence[Path],
    host: str,
    port: int,
    threads: int,
    device_budget: int | None = None,
    worker_file: Path | None = None,
) -> int:
    """Admit and serve the pipelines at ``spec_paths`` on ``threads`` torch threads until drained.

    They share one device under the worker budget (``device_budget``, else the worker
    file's, else the smallest of the specs'). Returns the exit code: 0 drained cleanly,
    1 refused, 2 bad spec, 3 jobs or components left when the drain timed out, or a
    pipeline failed to load.
    """
    specs = _read_specs(spec_paths)
    if specs is None:
        return ExitCode.BAD_INPUT
    try:
        settings = None if worker_file is None else load_worker_file(worker_file)
    except ConfigError as err:
        print(f"lifecycle serve: {worker_file}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    torch.set_num_threads(threads)
    limit, key = worker_budget(specs, device_budget, settings)
    shared = SharedDevice(device_budget=limit, budget_key=key)
    metrics = ServingMetrics(
        queue_depth=lambda: sum(p.batcher.depth for p in list(worker.pipelines.values())),
        resident_bytes=shared.resident_bytes,
    )
    orchestrators = []
    try:
        for spec in specs:
            orchestrator = Orchestrator(spec, shared=shared, observer=metrics.observe)
            orchestrators.append(orchestrator)
            orchestrator.admit()
    except AdmissionRefused as err:
        print(f"lifecycle serve: {err}", file=sys.stderr)  # every refusal, with its fix
        return ExitCode.REFUSED
    except ValueError as err:  # specs on different devices
        print(f"lifecycle serve: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    paths = {spec.name: path.resolve() for spec, path in zip(specs, spec_paths, strict=True)}
    worker = Worker(orchestrators, metrics, paths)
    config = uvicorn.Config(
        create_app(worker),
        host=host,
        port=port,
        http="httptools",
        loop="uvloop",
        log_config=None,
        access_log=False,
    )
    server = DrainingServer(config, worker)
    # uvicorn installs the same handler only once it runs: from here on a signal drains
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, server.handle_exit)
    signal.signal(signal.SIGHUP, Reloader(worker).handle)
    log.info(
        "serving.listening",
        pipelines=[spec.name for spec in specs],
        host=host,
        port=port,
        threads=threads,
        device_budget=limit,
    )
    threading.Thread(target=worker.start, name="load", daemon=True).start()
    server.run()
    if not server.drained:  # stopped by uvicorn itself (e.g. the port was taken)
        server.drained = worker.drain()
    return ExitCode.OK if server.drained and worker.error is None else ExitCode.FAILED


def _read_specs(paths: Sequence[Path]) -> list[PipelineSpec] | None:
    """Decode every spec; print what is wrong (a bad spec, two of one name) and return None."""
    specs = []
    for path in paths:
        try:
            specs.append(load_spec(path))
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
