"""Run the worker under uvicorn; SIGTERM drains it (needs the ``serve`` extra).

The drain handler is installed before the pipeline starts loading, so a signal that
arrives while it loads drains it too (once loaded: nothing is left behind, exit 0).
A signal that arrives earlier, while Python still imports the command, ends the
process the default way (exit 143): nothing is loaded then.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import torch
import uvicorn

from lifecycle.config import ConfigError, load_spec
from lifecycle.exits import ExitCode
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused
from lifecycle.serving.app import create_app
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Worker

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


def serve(spec_path: Path, host: str, port: int, threads: int) -> int:
    """Admit and serve the pipeline at ``spec_path`` on ``threads`` torch threads until drained.

    Returns the exit code: 0 drained cleanly, 1 refused, 2 bad spec, 3 jobs or
    components left when the drain timed out, or the pipeline failed to load.
    """
    try:
        spec = load_spec(spec_path)
    except ConfigError as err:
        print(f"lifecycle serve: {spec_path}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    torch.set_num_threads(threads)
    holder: list[Orchestrator] = []
    metrics = ServingMetrics(
        queue_depth=lambda: 0 if worker.batcher is None else worker.batcher.depth,
        resident_bytes=lambda: holder[0].resident_bytes() if holder else 0,
    )
    orchestrator = Orchestrator(spec, observer=metrics.observe)
    holder.append(orchestrator)
    try:
        orchestrator.admit()
    except AdmissionRefused as err:
        print(f"lifecycle serve: {err}", file=sys.stderr)  # every refusal, with its fix
        return ExitCode.REFUSED
    worker = Worker(orchestrator, metrics)
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
    log.info("serving.listening", pipeline=spec.name, host=host, port=port, threads=threads)
    threading.Thread(target=worker.start, name="load", daemon=True).start()
    server.run()
    if not server.drained:  # stopped by uvicorn itself (e.g. the port was taken)
        server.drained = worker.drain()
    return ExitCode.OK if server.drained and worker.error is None else ExitCode.FAILED
