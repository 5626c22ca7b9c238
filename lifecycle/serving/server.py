"""Run the worker under uvicorn; SIGTERM drains it (needs the ``serve`` extra).

The drain handler is installed before the pipeline starts loading, so a signal that
arrives while it loads drains it too (once loaded: nothing is left behind, exit 0).
A signal that arrives earlier, while Python still imports the command, ends the
process the default way (exit 143): nothing is loaded then.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import torch
import uvicorn
from fastapi import FastAPI

from lifecycle.config import ConfigError, PipelineSpec, ServingConfig, load_spec
from lifecycle.exits import ExitCode
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused
from lifecycle.serving.app import create_app
from lifecycle.serving.auth import DoorKeys
from lifecycle.serving.connections import guarded_protocol
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Worker

log = get_logger("lifecycle")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM or SIGINT drains the worker before exiting.

    While draining it keeps answering (new jobs get 503); once the queued and running
    jobs are done and everything is released, it stops. A second signal forces the exit.
    A drain that outlives ``serving.drain_timeout`` stops it too, with the reason.

    Args:
        config: uvicorn's settings.
        worker: the worker to drain.

    Attributes:
        drained: whether a drain ran to its end (cleanly or not).
        problem: what the drain left behind, or None.
    """

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker
        self.drained = False
        self.problem: str | None = None
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
        try:
            self.problem = self.worker.drain()
            self.drained = True
        finally:  # whatever the drain met, the server stops: never wait for a second signal
            _exit_if_abandoned(self.worker)
            self.should_exit = True


def serve(spec_path: Path, host: str, port: int, threads: int, keys: DoorKeys) -> int:
    """Admit and serve the pipeline at ``spec_path`` on ``threads`` torch threads until drained.

    The address is bound before anything is admitted or loaded, so a port that is taken
    or not allowed is bad input. ``keys`` lock the door (``lifecycle.serving.auth``).

    Returns the exit code: 0 drained cleanly, 1 refused, 2 bad spec or address, 3 jobs
    or components left when the drain timed out, or the pipeline failed to load.
    """
    try:
        spec = load_spec(spec_path)
    except ConfigError as err:
        print(f"lifecycle serve: {spec_path}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        listener = _listen(host, port)
    except OSError as err:
        print(
            f"lifecycle serve: cannot listen on {host}:{port}: {err.strerror or err}; pick "
            "another --port or --host, or stop what holds that one",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    with listener:
        return _serve(spec, listener, threads, keys)


def _serve(spec: PipelineSpec, listener: socket.socket, threads: int, keys: DoorKeys) -> int:
    torch.set_num_threads(threads)
    holder: list[Orchestrator] = []
    metrics = ServingMetrics(
        queue_depth=lambda: 0 if worker.batcher is None else worker.batcher.depth,
        resident_bytes=lambda: holder[0].resident_bytes() if holder else 0,
    )
    orchestrator = Orchestrator(spec, observer=metrics.observe)
    holder.append(orchestrator)
    admitting = time.perf_counter()
    try:
        orchestrator.admit()
    except AdmissionRefused as err:
        print(f"lifecycle serve: {err}", file=sys.stderr)  # every refusal, with its fix
        return ExitCode.REFUSED
    worker = Worker(orchestrator, metrics, admit_ms=(time.perf_counter() - admitting) * 1e3)
    server = DrainingServer(uvicorn_config(create_app(worker, keys), spec.serving), worker)
    # uvicorn installs the same handler only once it runs: from here on a signal drains
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, server.handle_exit)
    host, port = listener.getsockname()[:2]
    log.info(
        "serving.listening",
        pipeline=spec.name,
        host=host,
        port=port,
        threads=threads,
        api_key=keys.api is not None,  # whether the door is locked; never the keys
        admin_routes=keys.admin is not None,
    )
    threading.Thread(target=worker.start, name="load", daemon=True).start()
    server.run(sockets=[listener])
    if not server.drained:  # stopped by uvicorn itself, or the drain itself broke
        server.problem = worker.drain()
    _exit_if_abandoned(worker)
    return ExitCode.OK if server.problem is None and worker.error is None else ExitCode.FAILED


def _exit_if_abandoned(worker: Worker) -> None:
    """End the process with exit 3 at once when jobs outlived the drain.

    Their runner threads still compute and their clients still hold connections: the
    interpreter would wait for the threads at exit, and uvicorn for the connections.
    The drain has released the rest and logged the reason; nothing is left to save.
    """
    if worker.abandoned:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ExitCode.FAILED)


def uvicorn_config(app: FastAPI, settings: ServingConfig) -> uvicorn.Config:
    """Return uvicorn's settings for ``app``, with the connection bounds of ``settings``.

    httptools (bounded by ``guarded_protocol``) on uvloop, and no logging of uvicorn's
    own: the worker logs through structlog. uvicorn's ``timeout_keep_alive`` (5 s)
    closes idle keep-alive connections; its ``limit_concurrency`` and
    ``h11_max_incomplete_event_size`` are not set: the first counts only requests whose
    headers arrived, the second applies to h11 alone, and ``guarded_protocol`` bounds
    both at the connection instead.
    """
    return uvicorn.Config(
        app,
        http=guarded_protocol(settings),
        loop="uvloop",
        log_config=None,
        access_log=False,
    )


def _listen(host: str, port: int) -> socket.socket:
    """Return a socket bound to ``host:port`` (uvicorn listens on it).

    Raises:
        OSError: the host is unknown, the port is taken or not allowed.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
