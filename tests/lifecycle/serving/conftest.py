"""Fixtures of the serving tests: a worker served over loopback HTTP in this process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import httpx
import msgspec
import pytest
import torch

from attention import Platform, register_backend
from attention.backends.torch_flash import TorchFlashBackend, TorchFlashImpl
from attention.registry import unregister_backend
from lifecycle.device.shared import SharedDevice, worker_budget
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import Job, merged_batch, split_outputs
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Phase, Worker
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import PipelineSpec
from tests.conftest import PipelineFolders
from tests.lifecycle.conftest import ReferenceSpec, reference_maker
from tests.lifecycle.serving.file_gate import GATE_ENV, FileGate

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import uvicorn

from lifecycle.serving.app import create_app
from lifecycle.serving.auth import DoorKeys
from lifecycle.serving.server import uvicorn_config

if TYPE_CHECKING:
    from benchmarks.make_pipeline import Family

WATCHDOG_S = 120.0
"""The longest any serving test waits for anything."""


def loopback_client(
    url: str, timeout: httpx.Timeout | float = WATCHDOG_S, **kwargs: Any
) -> httpx.Client:
    """Return an HTTP client of the worker at ``url``: plain HTTP on loopback.

    It loads no certificates, having none to verify: httpx otherwise loads its CA bundle
    for every client, 30 ms of CPU, hundreds of times a suite.
    """
    return httpx.Client(base_url=url, timeout=timeout, verify=False, **kwargs)


@pytest.fixture
def openai() -> ModuleType:
    """The official openai client, imported by the tests that use it (half a CPU-second,
    which every xdist worker would pay at collection)."""
    return pytest.importorskip("openai")


def openai_client(openai: ModuleType, url: str, api_key: str) -> Any:
    """Return the official openai client of the worker at ``url``, never retrying.

    Its HTTP client loads no certificates, as ``loopback_client``: OpenAI's default one
    loads its CA bundle, 27 ms of CPU a client, for plain HTTP on loopback.
    """
    http = openai.DefaultHttpxClient(verify=False)
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, http_client=http)


@dataclass
class Served:
    """A worker answering on loopback, and what its orchestrator did.

    Attributes:
        url: the base URL.
        worker: the worker.
        moves: every weight move, in order.
        resident_at_moves: resident bytes right after each move.
        headers: what every client of ``client()`` sends (a key).
    """

    url: str
    worker: Worker
    moves: list[Move] = field(default_factory=list)
    resident_at_moves: list[int] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)

    def client(self, **kwargs: Any) -> httpx.Client:
        """Return an HTTP client for this worker, sending ``headers``."""
        return loopback_client(self.url, headers=self.headers, **kwargs)

    def get(self, path: str) -> httpx.Response:
        """GET ``path`` on a client of its own, sending ``headers``."""
        with self.client() as client:
            return client.get(path)


ServeSpec: TypeAlias = Callable[..., Served]
"""``serve_spec(spec, keys=None)``: serve ``spec`` with the door locked by ``keys``."""

ServeSpecs: TypeAlias = Callable[..., Served]
"""``serve_specs(specs, device_budget=None, paths=None, keys=None)``: one worker serving
them all."""


class Servers:
    """Workers served on loopback in this process, each drained by ``close``.

    Call it as ``serve_specs``: a worker serves every spec given, on one device under
    ``device_budget``; ``paths`` name the files they were read from (for reload);
    ``keys`` lock its door. Its uvicorn runs as the worker's does. The moves recorded
    are the first pipeline's.

    Args:
        platform: the platform every orchestrator admits on.
    """

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.running: list[tuple[uvicorn.Server, threading.Thread, Served]] = []

    def __call__(
        self,
        specs: list[PipelineSpec],
        device_budget: int | None = None,
        paths: dict[str, Path] | None = None,
        keys: DoorKeys | None = None,
    ) -> Served:
        """Serve ``specs`` from one worker; return it once ``/healthz`` answers."""
        holder: list[Served] = []

        def observe_moves(event: Event) -> None:
            if isinstance(event, Move):
                served = holder[0]
                served.moves.append(event)
                served.resident_at_moves.append(orchestrators[0].resident_bytes())

        metrics = ServingMetrics(queue_depth=lambda: 0, resident_bytes=lambda: 0)
        limit, key = worker_budget(specs, device_budget, None)  # as `lifecycle serve` does
        device = SharedDevice(device_budget=limit, budget_key=key)
        orchestrators = [
            Orchestrator(spec, platform=self.platform, observer=metrics.observe, shared=device)
            for spec in specs
        ]
        orchestrators[0].observe(observe_moves)  # a second observer beside the metrics
        worker = Worker(orchestrators, metrics, paths)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        host, port = sock.getsockname()
        served = Served(url=f"http://{host}:{port}", worker=worker)
        holder.append(served)
        worker.start()
        assert worker.phase is Phase.READY, worker.error
        server = uvicorn.Server(uvicorn_config(create_app(worker, keys), worker.bounds))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        with served.client() as client:
            for _ in range(int(WATCHDOG_S / 0.01)):
                if server.started and client.get("/healthz").status_code == 200:
                    break
                threading.Event().wait(0.01)
        self.running.append((server, thread, served))
        return served

    def close(self) -> None:
        """Drain every worker served, then tell its uvicorn to stop (``uvicorns_stop``).

        uvicorn notices on its next tick and then waits a tenth of a second for the
        connections it closed: about 0.2 s a server, which the test need not wait for.
        """
        for server, thread, served in self.running:
            served.worker.drain()
            server.should_exit = True
            _stopping.append(thread)


_stopping: list[threading.Thread] = []
"""The threads of the uvicorns told to stop, which ``uvicorns_stop`` waits for."""


@pytest.fixture(scope="session", autouse=True)
def uvicorns_stop() -> Iterator[None]:
    """Wait, once the tests are done, for every uvicorn told to stop; fail if one did not."""
    yield
    for thread in _stopping:
        thread.join(timeout=WATCHDOG_S)
    assert not [thread for thread in _stopping if thread.is_alive()]


@pytest.fixture
def serve_specs(cpu: Platform) -> Iterator[ServeSpecs]:
    """Serve workers on loopback in this process (``Servers``); drained after the test."""
    servers = Servers(cpu)
    yield servers
    servers.close()


@pytest.fixture
def serve_spec(serve_specs: ServeSpecs) -> ServeSpec:
    """Serve one spec on loopback in this process (a worker of its own device)."""

    def serve(spec: PipelineSpec, keys: DoorKeys | None = None) -> Served:
        return serve_specs([spec], keys=keys)

    return serve


def t2i_maker(reference: ReferenceSpec) -> Callable[..., PipelineSpec]:
    """Return the maker of the reference text-to-image spec with ``[serving]`` and
    ``[memory]`` changes."""

    def make(memory: dict[str, Any] | None = None, **serving: Any) -> PipelineSpec:
        raw = msgspec.to_builtins(reference())
        raw["serving"] = serving
        raw["memory"].update(memory or {})
        return decode_spec(msgspec.json.encode(raw).decode(), "json")

    return make


@pytest.fixture
def t2i_spec(reference_spec: ReferenceSpec) -> Callable[..., PipelineSpec]:
    """Make the reference text-to-image spec with ``[serving]`` and ``[memory]`` changes."""
    return t2i_maker(reference_spec)


SharedT2i: TypeAlias = Callable[..., Served]
"""``shared_t2i(**serving)``: the module's worker of the reference spec with these
``[serving]`` changes."""


@pytest.fixture(scope="module")
def module_servers(cpu: Platform) -> Iterator[Servers]:
    """Serve workers that live for the whole module; drained after its last test.

    For tests that only send requests and read their answers: a worker loads and warms
    up in a tenth of a CPU-second or more, which each of them would pay again. A test
    that changes the worker (sleeps, drains, cancels) or reads what it recorded (moves,
    metrics counts) serves its own with ``serve_spec``.
    """
    servers = Servers(cpu)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def shared_t2i(
    module_servers: Servers, root: Path, tmp_path_factory: pytest.TempPathFactory
) -> SharedT2i:
    """Serve the reference text-to-image spec once per module for each ``[serving]`` table
    (``module_servers``)."""
    make = t2i_maker(reference_maker(root, tmp_path_factory.mktemp("shared-t2i")))
    served: dict[tuple[tuple[str, Any], ...], Served] = {}

    def serve(**serving: Any) -> Served:
        key = tuple(sorted(serving.items()))
        if key not in served:
            served[key] = module_servers([make(**serving)])
        return served[key]

    return serve


def folder_spec(folder: Path, **serving: Any) -> PipelineSpec:
    """Return the spec of ``folder`` with ``[serving]`` settings."""
    table = "".join(f"{key} = {value}\n" for key, value in serving.items())
    return decode_spec(f'source = "{folder}"\ndevice = "cpu"\n[serving]\n{table}')


SharedFolder: TypeAlias = Callable[..., Served]
"""``shared_folder(family, **serving)``: the module's worker of that family's tiny folder
with these ``[serving]`` changes."""


@pytest.fixture(scope="module")
def shared_folder(module_servers: Servers, pipeline_folder: PipelineFolders) -> SharedFolder:
    """Serve a family's tiny folder once per module for each ``[serving]`` table
    (``module_servers``): a folder's worker loads and warms up in a few tenths of a
    CPU-second, which every test of it would pay again."""
    served: dict[tuple[str, tuple[tuple[str, Any], ...]], Served] = {}

    def serve(family: Family, **serving: Any) -> Served:
        key = (family, tuple(sorted(serving.items())))
        if key not in served:
            torch.set_num_threads(1)  # it warms up with one thread, as its tests run
            served[key] = module_servers([folder_spec(pipeline_folder(family), **serving)])
        return served[key]

    return serve


class Gate:
    """Where requests on the ``gated`` backend wait: ``reached`` is set once one calls
    its kernel, and they go on once the test sets ``opened``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()


GATE = Gate()


class GatedImpl(TorchFlashImpl):
    """torch_flash's kernel, which first waits at ``GATE``."""

    def forward_with_lse(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Say the gate is reached, wait until it opens, then attend as torch_flash does.

        Every unmasked call passes here: plain, causal, and each packed sequence.
        """
        GATE.reached.set()
        GATE.opened.wait(WATCHDOG_S)
        return super().forward_with_lse(*args, **kwargs)


class GatedBackend(TorchFlashBackend):
    """An out-of-tree backend whose requests stay in flight until the test opens ``GATE``.

    A request held so takes no CPU, however long a loaded machine takes to send the
    next ones; a slow request instead (many steps) could end before they arrive.
    """

    name: ClassVar[str] = "gated"  # type: ignore[misc]
    impl_cls = GatedImpl


@pytest.fixture
def gated() -> Iterator[Gate]:
    """Register the ``gated`` backend, its gate closed; open it and remove it after."""
    GATE.reached.clear()
    GATE.opened.clear()
    register_backend(GatedBackend)
    yield GATE
    GATE.opened.set()  # a failed test leaves no request waiting
    unregister_backend(GatedBackend.name)


@pytest.fixture
def file_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FileGate:
    """Install ``file_gated`` for the processes the test serves (``FileGate.path``), its gate
    closed."""
    gate = FileGate(tmp_path)
    monkeypatch.setenv(GATE_ENV, str(gate.folder))
    return gate


def run_alone(worker: Worker, job: Job) -> torch.Tensor:
    """Run ``job`` by itself through the embedded API, the way a batch of one runs."""
    batch = merged_batch([job], worker.shapes, worker.orchestrator.recipe)
    override = job.key.attention_backend
    with worker.orchestrator.request(f"alone-{job.id}", attention_backend=override) as request:
        request.run_all(batch)
    split_outputs([job], batch)
    assert job.output is not None
    return job.output
