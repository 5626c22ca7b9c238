"""A lean HTTP/1.1 load generator for the serving benchmark, run as its own process.

``python -m benchmarks._http_load`` reads one JSON object on stdin (``host``,
``port``, ``path``, ``clients`` and ``bodies``, a list of JSON request bodies),
opens one keep-alive connection per simulated client with ``asyncio.open_connection``,
and has client k POST bodies k, k + clients, ... one after another. It writes one
JSON object on stdout: every request's latency in seconds, the wall time from the
first request sent to the last answer read, and any status other than 200.

Why not httpx: a pool of sync httpx clients on threads spends about as much CPU per
request as the server it measures, and on a 2-core machine that CPU is taken from the
server. Here a request costs one ``write`` and a ``Content-Length`` read on an event
loop, in a process of its own (no GIL shared with anything else). The tests keep the
real clients (httpx, openai).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import msgspec


class LoadPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to send: ``bodies`` spread over ``clients`` connections to ``host:port``."""

    host: str
    port: int
    path: str
    clients: int
    bodies: list[Any]


class LoadResult(msgspec.Struct, frozen=True, kw_only=True):
    """What was measured: per-request latencies (s), the wall time (s), bad statuses."""

    latencies: list[float]
    wall: float
    bad_statuses: list[int]


def _request(plan: LoadPlan, body: Any) -> bytes:
    payload = msgspec.json.encode(body)
    head = (
        f"POST {plan.path} HTTP/1.1\r\nhost: {plan.host}:{plan.port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _answer(reader: asyncio.StreamReader) -> int:
    """Read one response (``Content-Length`` framed); return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def _run(plan: LoadPlan) -> LoadResult:
    requests = [_request(plan, body) for body in plan.bodies]
    connections = [await asyncio.open_connection(plan.host, plan.port) for _ in range(plan.clients)]
    latencies: list[float] = []
    bad: list[int] = []

    async def client(k: int) -> None:
        reader, writer = connections[k]
        for request in requests[k :: plan.clients]:
            started = time.perf_counter()
            writer.write(request)
            status = await _answer(reader)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                bad.append(status)

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(plan.clients)))
    wall = time.perf_counter() - started
    for _, writer in connections:
        writer.close()
    return LoadResult(latencies=latencies, wall=wall, bad_statuses=bad)


def main() -> None:
    """Read the plan on stdin, run it, write the result on stdout."""
    plan = msgspec.json.decode(sys.stdin.buffer.read(), type=LoadPlan)
    result = asyncio.run(_run(plan))
    sys.stdout.buffer.write(msgspec.json.encode(result))


if __name__ == "__main__":
    main()
