"""What the connection bounds cost a request (issue 21 item 7): guarded httptools vs plain.

The worker runs uvicorn's httptools protocol with header, body and connection bounds
(``lifecycle.serving.connections``): each request starts and stops two timers and
counts its head. Two uvicorn servers in this process serve the same trivial ASGI app,
one on uvicorn's own ``HttpToolsProtocol``, one on the worker's; a client sends
``ROUNDS`` x ``REQUESTS`` small POSTs with a JSON body over one keep-alive connection to
each, the two alternating round by round. Figures: the median round's microseconds
per request for each, and the median over rounds of guarded / plain.

Run: ``python -m benchmarks connections``.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from benchmarks._environment import announce
from lifecycle.serving.connections import guarded_protocol
from lifecycle.spec.structs import ServingConfig

ROUNDS = 9
REQUESTS = 1000
BODY = b'{"input": "a red fox jumps over the lazy dog"}'


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Read the body, answer 200 with a small JSON body (lifespan ignored)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"{}"})


def serve(protocol: type[HttpToolsProtocol]) -> tuple[uvicorn.Server, str]:
    """Start a server on ``protocol`` on a free loopback port; return it and its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, http=protocol, loop="uvloop", lifespan="off", log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    host, port = sock.getsockname()
    return server, f"http://{host}:{port}"


def round_us(client: httpx.Client) -> float:
    """Return the microseconds per request of one round of POSTs on ``client``."""
    started = time.perf_counter()
    for _ in range(REQUESTS):
        client.post("/", content=BODY, headers={"content-type": "application/json"})
    return (time.perf_counter() - started) / REQUESTS * 1e6


def main() -> None:
    """Print the per-request cost of the plain and the guarded protocol, side by side."""
    announce("connections")
    servers = [serve(HttpToolsProtocol), serve(guarded_protocol(ServingConfig()))]
    clients = [httpx.Client(base_url=url) for _, url in servers]
    for client in clients:
        round_us(client)  # warm up: connections open, code paths hot
    plain: list[float] = []
    guarded: list[float] = []
    for round_ in range(ROUNDS):
        first, second = (0, 1) if round_ % 2 == 0 else (1, 0)
        times = {first: round_us(clients[first]), second: round_us(clients[second])}
        plain.append(times[0])
        guarded.append(times[1])
    ratios = [g / p for g, p in zip(guarded, plain, strict=True)]
    print("| protocol | µs per request (median round) |")
    print("|---|---|")
    print(f"| uvicorn HttpToolsProtocol | {statistics.median(plain):.0f} |")
    print(f"| guarded (the worker's) | {statistics.median(guarded):.0f} |")
    print(
        f"\nguarded / plain: {statistics.median(ratios):.3f}x "
        f"({min(ratios):.3f}-{max(ratios):.3f} over {ROUNDS} rounds)"
    )
    for client in clients:
        client.close()
    for server, _ in servers:
        server.should_exit = True
