"""Run the worker under uvicorn; SIGTERM drains it, SIGHUP reloads every spec (needs the
``serve`` extra).

The drain handler is installed before the pipelines start loading, so a signal that
arrives while they load drains them too (once loaded: nothing is left behind, exit 0).
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
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

import torch
import uvicorn
from fastapi import FastAPI

from lifecycle.autotune import tune
from lifecycle.device.shared import SharedDevice, worker_budget
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving import changes
from lifecycle.serving.announce import base_url, draining_line, ready_line
from lifecycle.serving.app import create_app
from lifecycle.serving.auth import DoorKeys, page_access
from lifecycle.serving.connections import guarded_protocol
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Phase, Worker
from lifecycle.spec.structs import PipelineSpec, ServingConfig, WorkerFile

__all__ = ["listen", "open_worker", "serve"]

log = get_logger("lifecycle")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM or SIGINT drains the worker before exiting.

    While draining it keeps answering (new jobs get 503); once the queued and running
    jobs are done and everything is released, it stops. A second signal forces the exit.
    A drain that outlives ``serving.drain_timeout`` stops it too, ending the process at once.

    Args:
        config: uvicorn's settings.
        worker: the worker to drain.
        announce: where to say that it drains, for a person (None: nowhere).
        abandoned_exit: the process's exit status when jobs outlive the drain.

    Attributes:
        drained: whether a drain ran to its end, and every job finished and every
            component was released.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        worker: Worker,
        announce: TextIO | None,
        abandoned_exit: int,
    ) -> None:
        super().__init__(config)
        self.worker = worker
        self.announce = announce
        self.abandoned_exit = abandoned_exit
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
        if self.announce is not None:
            unfinished = sum(served.batcher.in_flight for served in self.worker.served())
            print(draining_line(self._signal.name, unfinished), file=self.announce, flush=True)
        try:
            self.drained = self.worker.drain()
        finally:  # whatever the drain met, the server stops: never wait for a second signal
            _exit_if_abandoned(self.worker, self.abandoned_exit)
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


def open_worker(
    specs: Sequence[PipelineSpec],
    spec_paths: Sequence[Path],
    threads: int,
    device_budget: int | None = None,
    settings: WorkerFile | None = None,
) -> Worker:
    """Admit the pipelines of ``specs`` (read from ``spec_paths``) on one shared device, on
    ``threads`` torch threads: the worker, not yet loaded.

    They share the device under the worker budget (``device_budget``, else the worker
    file's, else the smallest of the specs'); ``acceleration = "auto"`` first chooses what
    a spec left open (``lifecycle.autotune``).

    Raises:
        AdmissionRefused: a pipeline was refused, with every reason.
        ValueError: the specs run on different kinds of device.
    """
    torch.set_num_threads(threads)
    limit, key = worker_budget(specs, device_budget, settings)
    shared = SharedDevice(device_budget=limit, budget_key=key, serves=True)
    metrics = ServingMetrics(
        queue_depth=lambda: sum(p.batcher.depth for p in list(worker.pipelines.values())),
        resident_bytes=shared.resident_bytes,
        recompiles=lambda: worker.recompiles(),
    )
    orchestrators = []
    admit_ms = {}
    for asked in specs:
        spec, _ = tune(asked)  # acceleration = "auto" chooses what the spec left open
        orchestrator = Orchestrator(spec, shared=shared, observer=metrics.observe)
        orchestrators.append(orchestrator)
        admitting = time.perf_counter()
        orchestrator.admit()
        admit_ms[spec.name] = (time.perf_counter() - admitting) * 1e3
    paths = {spec.name: path.resolve() for spec, path in zip(specs, spec_paths, strict=True)}
    worker = Worker(orchestrators, metrics, paths, admit_ms)
    return worker


def serve(
    worker: Worker,
    listener: socket.socket,
    keys: DoorKeys,
    announce: TextIO | None,
    *,
    abandoned_exit: int,
) -> bool:
    """Load ``worker`` and serve it on ``listener`` until SIGTERM or SIGINT drains it.

    ``keys`` lock the door (``lifecycle.serving.auth``). ``announce`` gets a line for a
    person when the worker is ready and when it drains (``lifecycle.serving.announce``).
    A drain that outlives ``serving.drain_timeout`` ends the process at once with status
    ``abandoned_exit``. Returns whether the worker ended cleanly: every pipeline loaded,
    and the drain finished every job and released every component.
    """
    server = DrainingServer(
        uvicorn_config(create_app(worker, keys), worker.bounds), worker, announce, abandoned_exit
    )
    # uvicorn installs the same handler only once it runs: from here on a signal drains
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, server.handle_exit)
    signal.signal(signal.SIGHUP, Reloader(worker).handle)
    host, port = listener.getsockname()[:2]
    log.info(
        "serving.listening",
        pipelines=worker.names,
        host=host,
        port=port,
        threads=torch.get_num_threads(),
        device_budget=worker.shared.budget.limit,
        api_key=keys.api is not None,  # whether the door is locked; never the keys
        admin_routes=keys.admin is not None,
    )
    url = base_url(host, port)
    threading.Thread(
        target=_start, args=(worker, keys, url, announce), name="load", daemon=True
    ).start()
    server.run(sockets=[listener])
    if worker.phase is not Phase.DRAINING:  # stopped by uvicorn itself, not by a signal
        server.drained = worker.drain()
    _exit_if_abandoned(worker, abandoned_exit)
    return server.drained and worker.error is None


def _start(worker: Worker, keys: DoorKeys, url: str, announce: TextIO | None) -> None:
    """Load and warm up the worker's pipelines; once it is ready, say so to ``announce``."""
    worker.start()
    if announce is not None and worker.phase is Phase.READY:
        pages = (orchestrator.spec.serving.status_page for orchestrator in worker.orchestrators)
        line = ready_line(url, worker.names, keys, page_access(pages, keys))
        print(line, file=announce, flush=True)


def _exit_if_abandoned(worker: Worker, status: int) -> None:
    """End the process with exit ``status`` at once when jobs outlived the drain.

    Their runner threads still compute and their clients still hold connections: the
    interpreter would wait for the threads at exit, and uvicorn for the connections.
    The drain has released the rest and logged the reason; nothing is left to save.
    """
    if worker.abandoned:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


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


def listen(host: str, port: int) -> socket.socket:
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
