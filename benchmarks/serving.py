"""Measure ``lifecycle serve`` under concurrent clients (issue 13).

Embeddings (``examples/minilm_embed.toml``, one sentence a request): throughput and
p50/p99 latency over HTTP at 1, 4, 16 and 64 concurrent clients, against the embedded
API at batch 1 (one ``Orchestrator`` request per sentence, in this process). Goal: at
least 2.5x the embedded throughput at 16 clients, which only batching can give.

Images (``examples/tiny_t2i.toml``, 2 steps, 16x16): the same at 1 and 16 clients,
with no budget and with a budget that holds one component at a time (every stage
evicts). The server's own overhead: the p50 HTTP round trip at one client minus the
p50 compute of the same request through the embedded API.

The worker runs as a subprocess on loopback with its default settings; the clients
are threads in this process with one httpx client each. On a shared 2-core machine
server and clients compete for the cores, so the figures are conservative.

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
import torch

from components.batch import Batch
from components.kinds.minilm_text_encoder import PROMPTS
from lifecycle.orchestrator import Orchestrator

ROOT = Path(__file__).resolve().parents[1]
EMBED_SPEC = ROOT / "examples" / "minilm_embed.toml"
IMAGE_SPEC = ROOT / "examples" / "tiny_t2i.toml"
EVICTING_BUDGET = 260_000  # the tiny VAE (248,588 B) alone
CLIENTS = (1, 4, 16, 64)
REQUESTS_PER_CLIENT = {1: 40, 4: 20, 16: 10, 64: 4}


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
        [sys.executable, "-m", "lifecycle", "serve", str(spec), "--port", str(port)],
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


def load(
    url: str, path: str, bodies: Callable[[int], dict[str, Any]], clients: int
) -> dict[str, float]:
    """Send ``REQUESTS_PER_CLIENT`` requests from each of ``clients`` threads; summarise."""
    count = REQUESTS_PER_CLIENT.get(clients, 10)
    latencies: list[float] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            for j in range(count):
                started = time.perf_counter()
                response = http.post(path, json=bodies(k * count + j))
                response.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - started
    latencies.sort()
    return {
        "rps": len(latencies) / wall,
        "p50": 1e3 * statistics.median(latencies),
        "p99": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def embedded(spec: Path, batches: list[Batch]) -> list[float]:
    """Run each batch as one embedded request; return each one's seconds."""
    seconds = []
    with Orchestrator.from_file(spec) as orch:
        orch.load()
        for batch in batches:
            started = time.perf_counter()
            with orch.request() as request:
                for stage in orch.spec.stages:
                    request.run(stage.name, batch)
            seconds.append(time.perf_counter() - started)
    return seconds


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


def row(label: str, clients: int, stats: dict[str, float], base: float) -> str:
    return (
        f"| {label} | {clients} | {stats['rps']:.1f} | {stats['p50']:.1f} | "
        f"{stats['p99']:.1f} | {stats['rps'] / base:.2f}x |"
    )


def main() -> None:
    """Print the serving tables."""
    when = time.strftime("%Y-%m-%d %H:%M")
    print(f"_{when} UTC, {os.cpu_count()} CPUs, torch {torch.__version__}_\n")
    header = (
        "| workload | clients | req/s | p50 ms | p99 ms | vs embedded batch 1 |\n"
        "|---|---:|---:|---:|---:|---:|"
    )

    embed_seconds = embedded(
        EMBED_SPEC,
        [Batch(generator=torch.Generator(), prompts=[sentence(i)]) for i in range(40)],
    )[5:]  # the first requests warm up
    embed_rps = 1 / statistics.mean(embed_seconds)
    print(header)
    print(
        f"| embeddings, embedded API | 1 | {embed_rps:.1f} | "
        f"{1e3 * statistics.median(embed_seconds):.1f} | - | 1.00x |"
    )
    with worker(EMBED_SPEC) as url:
        warm(url, "/v1/embeddings", lambda i: {"input": sentence(i)})
        embed_http: dict[int, dict[str, float]] = {}
        for clients in CLIENTS:
            embed_http[clients] = load(
                url, "/v1/embeddings", lambda i: {"input": sentence(i)}, clients
            )
            print(row("embeddings over HTTP", clients, embed_http[clients], embed_rps))

    image_seconds = embedded(IMAGE_SPEC, [image_batch(i) for i in range(30)])[5:]
    image_rps = 1 / statistics.mean(image_seconds)
    print(
        f"| images, embedded API | 1 | {image_rps:.1f} | "
        f"{1e3 * statistics.median(image_seconds):.1f} | - | 1.00x |"
    )

    def image_body(i: int) -> dict[str, Any]:
        return {"prompt": sentence(i), "seed": i, "steps": 2}

    image_http: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for label, spec in (
            ("images", IMAGE_SPEC),
            ("images, evicting budget", budget_spec(Path(folder))),
        ):
            with worker(spec) as url:
                warm(url, "/v1/images/generations", image_body)
                for clients in (1, 16):
                    stats = load(url, "/v1/images/generations", image_body, clients)
                    if spec == IMAGE_SPEC:
                        image_http[clients] = stats
                    print(row(label, clients, stats, image_rps))

    print("\n| overhead at batch 1 | HTTP p50 ms | embedded p50 ms | server overhead ms |")
    print("|---|---:|---:|---:|")
    for label, http, compute in (
        ("embeddings", embed_http[1]["p50"], 1e3 * statistics.median(embed_seconds)),
        ("images", image_http[1]["p50"], 1e3 * statistics.median(image_seconds)),
    ):
        print(f"| {label} | {http:.1f} | {compute:.1f} | {http - compute:.1f} |")
    speedup = embed_http[16]["rps"] / embed_rps
    print(f"\nembeddings at 16 clients: {speedup:.2f}x the embedded API at batch 1 (goal >= 2.5x)")


if __name__ == "__main__":
    main()
