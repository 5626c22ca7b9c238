"""Measure ``lifecycle serve`` under concurrent clients (issue 13).

Embeddings (``examples/minilm_embed.toml``, one sentence a request): throughput and
p50/p99 latency over HTTP at 1, 4, 16 and 64 concurrent clients, against the embedded
API at batch 1 (one ``Orchestrator`` request per sentence, in this process). Goal: at
least 2.5x the embedded throughput at 16 clients, which only batching can give.

Images (``examples/tiny_t2i.toml``, 2 steps, 16x16): the same at 1 and 16 clients,
with no budget and with a budget that holds one component at a time (every stage
evicts). The server's own overhead: the p50 HTTP round trip at one client minus the
p50 compute of the same request through the embedded API.

The same embedding jobs are also submitted to the worker's queue in this process,
with no HTTP, at 1 and 16 submitters: what batching gives by itself.

Each HTTP level and the embedded API run as many requests in alternating rounds
(order reversed every round), so that the drift of a shared machine hits both
alike; figures are medians over rounds.

The worker runs as a subprocess on loopback with its default settings and the same
torch intra-op thread count as the embedded API (``--threads``; torch's own
default, one thread per core, would have its compute threads fight the event loop
and the clients for the cores). The HTTP clients are a lean load generator in a
process of their own (``benchmarks._http_load``): asyncio, raw HTTP/1.1 keep-alive,
one connection per client, each request timed from its write to its last byte.
A thread pool of httpx clients spent about as much CPU per request as the server it
measured; the tests keep the real clients (httpx, openai). On a shared 2-core machine
server and clients still compete for the cores, so the figures are conservative.

Requests over time (``benchmarks._requests_over_time``): the cost of streaming against
not streaming, of a preview against a denoising step, and the latency of a
high-priority job under a full low-priority queue against an empty one.

Run: ``python -m benchmarks serving``.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import torch

from benchmarks import _requests_over_time
from benchmarks._http_load import LoadPlan, LoadResult
from components.batch import Batch
from components.kinds.minilm_text_encoder import PROMPTS
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import BatchKey, Job, estimate_tokens
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Worker

ROOT = Path(__file__).resolve().parents[1]
EMBED_SPEC = ROOT / "examples" / "minilm_embed.toml"
IMAGE_SPEC = ROOT / "examples" / "tiny_t2i.toml"
EVICTING_BUDGET = 260_000  # the tiny VAE (248,588 B) alone
CLIENTS = (1, 4, 16, 64)
REQUESTS_PER_CLIENT = {1: 16, 4: 8, 16: 4, 64: 2}
ROUNDS = 3


def sentence(i: int) -> str:
    """Return the i-th benchmark sentence."""
    return PROMPTS[i % len(PROMPTS)]


@contextmanager
def worker(spec: Path) -> Iterator[str]:
    """Run ``lifecycle serve spec`` on a free loopback port; yield its URL once ready."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "lifecycle", "serve", str(spec), "--port", str(port)),
            *("--threads", str(torch.get_num_threads())),  # as pinned for the embedded API
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=120)


def warm(url: str, path: str, bodies: Callable[[int], dict[str, Any]]) -> None:
    """Send each distinct request once, as the embedded runs skip their first ones."""
    with httpx.Client(base_url=url, timeout=600) as http:
        for i in range(len(PROMPTS)):
            http.post(path, json=bodies(i)).raise_for_status()


def concurrently(clients: int, request: Callable[[int], None]) -> dict[str, float]:
    """Run ``request(i)`` ``REQUESTS_PER_CLIENT`` times on each of ``clients`` threads.

    Returns the throughput and the p50 and p99 latency (ms) of single requests.
    """
    count = REQUESTS_PER_CLIENT.get(clients, 10)
    latencies: list[float] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(count):
            started = time.perf_counter()
            request(k * count + j)
            with lock:
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return summary(latencies, time.perf_counter() - started)


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    """Return the throughput and the p50 and p99 latency (ms) of single requests."""
    latencies = sorted(latencies)
    return {
        "rps": len(latencies) / wall,
        "p50": 1e3 * statistics.median(latencies),
        "p99": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def load(
    url: str, path: str, bodies: Callable[[int], dict[str, Any]], clients: int
) -> dict[str, float]:
    """Post ``bodies(i)`` to ``path`` from ``clients`` keep-alive connections; summarise.

    The clients run in a process of their own (``benchmarks._http_load``).
    """
    host, _, port = url.removeprefix("http://").partition(":")
    total = clients * REQUESTS_PER_CLIENT.get(clients, 10)
    plan = LoadPlan(
        host=host,
        port=int(port),
        path=path,
        clients=clients,
        bodies=[bodies(i) for i in range(total)],
    )
    answer = subprocess.run(
        [sys.executable, "-m", "benchmarks._http_load"],
        input=msgspec.json.encode(plan),
        capture_output=True,
        check=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    result = msgspec.json.decode(answer.stdout, type=LoadResult)
    if result.bad_statuses:
        raise RuntimeError(f"the worker answered {sorted(set(result.bad_statuses))}")
    return summary(result.latencies, result.wall)


class Embedded:
    """The embedded API at batch 1: one orchestrator request per job, in this process.

    Args:
        spec: the pipeline to load.
    """

    def __init__(self, spec: Path) -> None:
        self.orchestrator = Orchestrator.from_file(spec)
        self.orchestrator.load()

    def run(self, batches: list[Batch]) -> dict[str, float]:
        """Run each batch as one request, one after another; summarise like ``load``."""
        seconds = []
        started = time.perf_counter()
        for batch in batches:
            began = time.perf_counter()
            with self.orchestrator.request() as request:
                request.run_all(batch)
            seconds.append(time.perf_counter() - began)
        wall = time.perf_counter() - started
        return {"rps": len(batches) / wall, "p50": 1e3 * statistics.median(seconds)}


def image_batch(i: int) -> Batch:
    """Return image request i for the embedded API, as the worker builds it alone."""
    generator = torch.Generator().manual_seed(i)
    return Batch(
        generator=generator,
        steps=2,
        prompts=[sentence(i)],
        latents=[torch.randn(16, 4, generator=generator)],
    )


def budget_spec(folder: Path) -> Path:
    """Write the tiny text-to-image spec with the evicting budget; return its path."""
    text = IMAGE_SPEC.read_text().replace(
        "[memory]", f"[memory]\ndevice_budget = {EVICTING_BUDGET}"
    )
    path = folder / "tiny_t2i_budget.toml"
    path.write_text(text)
    return path


def queued(worker: Worker, clients: int) -> dict[str, float]:
    """Submit embedding jobs to the worker's queue from ``clients`` threads, no HTTP."""

    def submit(i: int) -> None:
        job = Job(
            id=f"q{i}",
            key=BatchKey(endpoint="embeddings"),
            prompts=[sentence(i)],
            tokens=estimate_tokens([sentence(i)]),
        )
        worker.submit(job).result()

    return concurrently(clients, submit)


def embedding_batch(i: int) -> Batch:
    """Return embedding request i for the embedded API."""
    return Batch(generator=torch.Generator(), prompts=[sentence(i)])


def compare(
    label: str,
    url: str,
    path: str,
    body: Callable[[int], dict[str, Any]],
    local: Embedded,
    batch: Callable[[int], Batch],
    clients: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """Time HTTP load and the embedded API in alternating rounds; print the medians.

    Each round runs as many requests both ways, back to back, in an order reversed
    every round; the ratio is the median over rounds of HTTP / embedded throughput.
    """
    total = clients * REQUESTS_PER_CLIENT.get(clients, 10)
    https: list[dict[str, float]] = []
    bases: list[dict[str, float]] = []
    for round_ in range(ROUNDS):
        steps = [
            lambda: https.append(load(url, path, body, clients)),
            lambda: bases.append(local.run([batch(i) for i in range(total)])),
        ]
        for step in steps if round_ % 2 == 0 else steps[::-1]:
            step()
    ratio = statistics.median(h["rps"] / b["rps"] for h, b in zip(https, bases, strict=True))
    http = {key: statistics.median(h[key] for h in https) for key in ("rps", "p50", "p99")}
    base = {key: statistics.median(b[key] for b in bases) for key in ("rps", "p50")}
    print(
        f"| {label} | {clients} | {http['rps']:.1f} | {http['p50']:.1f} | {http['p99']:.1f} "
        f"| {base['rps']:.1f} | {ratio:.2f}x |"
    )
    return http, {**base, "ratio": ratio}


def main() -> None:
    """Print the serving tables."""
    when = time.strftime("%Y-%m-%d %H:%M")
    print(f"_{when} UTC, {os.cpu_count()} CPUs, torch {torch.__version__}_\n")
    print(
        "| workload | clients | req/s | p50 ms | p99 ms | embedded batch 1 req/s "
        "| ratio (median of rounds) |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    overhead: dict[str, tuple[float, float]] = {}
    embed_ratio = 0.0
    local = Embedded(EMBED_SPEC)
    local.run([embedding_batch(i) for i in range(len(PROMPTS))])  # warm up
    with worker(EMBED_SPEC) as url:
        warm(url, "/v1/embeddings", lambda i: {"input": sentence(i)})
        for clients in CLIENTS:
            http, base = compare(
                "embeddings",
                url,
                "/v1/embeddings",
                lambda i: {"input": sentence(i)},
                local,
                embedding_batch,
                clients,
            )
            if clients == 1:
                overhead["embeddings"] = (http["p50"], base["p50"])
            if clients == 16:
                embed_ratio = base["ratio"]
    local.orchestrator.close()

    # the same batching without HTTP: jobs straight into the worker's queue
    metrics = ServingMetrics(queue_depth=lambda: 0, resident_bytes=lambda: 0)
    in_process = Worker([Orchestrator.from_file(EMBED_SPEC)], metrics)
    in_process.start()
    local = Embedded(EMBED_SPEC)
    for clients in (1, 16):
        total = clients * REQUESTS_PER_CLIENT.get(clients, 10)
        rounds = [
            (queued(in_process, clients), local.run([embedding_batch(i) for i in range(total)]))
            for _ in range(ROUNDS)
        ]
        ratio = statistics.median(q["rps"] / b["rps"] for q, b in rounds)
        q_rps = statistics.median(q["rps"] for q, _ in rounds)
        b_rps = statistics.median(b["rps"] for _, b in rounds)
        p50 = statistics.median(q["p50"] for q, _ in rounds)
        print(
            f"| embeddings, worker queue without HTTP | {clients} | {q_rps:.1f} | {p50:.1f} "
            f"| - | {b_rps:.1f} | {ratio:.2f}x |"
        )
    in_process.drain()
    local.orchestrator.close()

    def image_body(i: int) -> dict[str, Any]:
        return {"prompt": sentence(i), "seed": i, "steps": 2}

    local = Embedded(IMAGE_SPEC)
    local.run([image_batch(i) for i in range(len(PROMPTS))])  # warm up
    with tempfile.TemporaryDirectory() as folder:
        for label, spec in (
            ("images", IMAGE_SPEC),
            ("images, evicting budget", budget_spec(Path(folder))),
        ):
            with worker(spec) as url:
                warm(url, "/v1/images/generations", image_body)
                for clients in (1, 16):
                    http, base = compare(
                        label,
                        url,
                        "/v1/images/generations",
                        image_body,
                        local,
                        image_batch,
                        clients,
                    )
                    if clients == 1 and spec == IMAGE_SPEC:
                        overhead["images"] = (http["p50"], base["p50"])
    local.orchestrator.close()
    with worker(IMAGE_SPEC) as url:
        _requests_over_time.streaming(url)
    _requests_over_time.previews(IMAGE_SPEC)
    _requests_over_time.priorities(IMAGE_SPEC)

    print("\n| overhead at batch 1 | HTTP p50 ms | embedded p50 ms | server overhead ms |")
    print("|---|---:|---:|---:|")
    for label, (http_ms, compute_ms) in overhead.items():
        print(f"| {label} | {http_ms:.1f} | {compute_ms:.1f} | {http_ms - compute_ms:.1f} |")
    print(f"\nembeddings at 16 clients: {embed_ratio:.2f}x the embedded API at batch 1 (goal 2.5x)")


if __name__ == "__main__":
    main()
