"""Reading ``GET /v1/events`` in tests: a thread that parses server-sent events as they come,
and the stream's race between a snapshot and the moves still queued for its client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from lifecycle.serving.board import server_sent
from lifecycle.serving.status import worker_status
from lifecycle.serving.worker import Worker
from tests.lifecycle.serving.conftest import WATCHDOG_S, loopback_client

Message = dict[str, Any]


class EventReader:
    """Read a worker's event stream on a thread until it ends or ``close`` is called.

    Args:
        url: the worker's base URL.
        headers: sent with the request (an API key).

    Attributes:
        status: the response's status.
        error: the error object of a response that is not a stream (401, 403), else {}.
        seen: every message read so far, in order.
        ended: set once the server ended the stream (or the connection failed).
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.seen: list[Message] = []
        self.ended = threading.Event()
        self._incoming: queue.Queue[Message] = queue.Queue()
        self._client = loopback_client(url, httpx.Timeout(WATCHDOG_S, read=None))
        self._response = self._client.send(
            self._client.build_request("GET", "/v1/events", headers=headers), stream=True
        )
        self.status = self._response.status_code
        self.error: Message = {}
        if self.status != 200:
            self.error = json.loads(self._response.read())["error"]
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._response.iter_lines():
                if line.startswith("data: "):
                    message = json.loads(line.removeprefix("data: "))
                    self.seen.append(message)
                    self._incoming.put(message)
        except httpx.HTTPError:
            pass  # closed by the test, or by the server going away
        finally:
            self.ended.set()

    def until(self, wanted: Callable[[Message], bool]) -> Message:
        """Return the next message that ``wanted`` accepts, failing after the watchdog."""
        while True:
            try:
                message = self._incoming.get(timeout=WATCHDOG_S)
            except queue.Empty:
                raise AssertionError("no such message came: the watchdog fired") from None
            if wanted(message):
                return message

    def close(self) -> None:
        """Disconnect: shut the socket down, which wakes the reading thread, then close."""
        stream = self._response.extensions.get("network_stream")
        sock = None if stream is None else stream.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # the server closed it first
                sock.shutdown(socket.SHUT_RDWR)
        self._response.close()
        self._client.close()
        self._thread.join(timeout=WATCHDOG_S)


def is_snapshot(message: Message) -> bool:
    """Tell whether ``message`` is a ``status.snapshot``."""
    return message.get("type") == "status.snapshot"


def event_of(kind: str) -> Callable[[Message], bool]:
    """Return a test for an orchestrator event of type ``kind``."""
    return lambda message: message.get("event", {}).get("type") == kind


def moves(messages: list[Message]) -> list[Message]:
    """Return the ``residency.moved`` events among ``messages``, in order."""
    return [m["event"] for m in messages if event_of("residency.moved")(m)]


def evicting_spec(root: Path, folder: Path) -> Path:
    """Write examples/tiny_t2i.toml with a budget that evicts and batches of one into
    ``folder``; return its path.

    300,000 B holds the transformer (170,384 B) or the VAE (248,588 B), never the text
    encoder (138,240 B) beside the transformer: every request evicts.
    """
    text = (root / "examples" / "tiny_t2i.toml").read_text(encoding="utf-8")
    text = text.replace("[memory]\n", "[memory]\ndevice_budget = 300000\n", 1)
    path = folder / "tiny_t2i_evicting.toml"
    path.write_text(text + "\n[serving]\nmax_batch = 1\n", encoding="utf-8")
    return path


RACE_BUDGET = 420_000
"""Holds the transformer (170,384 B) beside the VAE (248,588 B) or the text encoder
(138,240 B), never beside both."""


def snapshot_race(worker: Worker) -> list[bytes]:
    """Play the stream's race on ``worker`` (the reference pipeline under ``RACE_BUDGET``,
    its transformer resident) and return what one client is sent, in order.

    The stream drains its client's buffer, then reads a snapshot: moves published in
    between reach the client after that snapshot, which already shows them. Here the
    stream drains the VAE's offload; the text encoder goes resident and back and the VAE
    resident again before the snapshot is read (it shows the VAE resident, the text
    encoder not); the VAE's last offload comes after it. Played in that order with the
    board and the snapshot the stream uses, so the race happens every time.
    """
    orchestrator = worker.orchestrator
    for name in ("text_encoder", "vae"):  # the warm-up leaves either where it was last
        if orchestrator.component(name).resident_bytes:
            orchestrator.offload(name)
    orchestrator.onload("vae")
    board = worker.board

    def snapshot() -> bytes:
        return server_sent(msgspec.json.encode(worker_status(worker)))

    async def play() -> list[bytes]:
        client = board.subscribe()
        try:
            history, _, _ = await client.next()
            sent = [*history, snapshot()]
            orchestrator.offload("vae")
            drained, _, _ = await client.next()
            # published after the stream drained its client, before it reads the snapshot
            orchestrator.onload("text_encoder")
            orchestrator.offload("text_encoder")
            orchestrator.onload("vae")
            sent += [*drained, snapshot()]
            orchestrator.offload("vae")  # news to that snapshot
            queued, _, _ = await client.next()
            return [*sent, *queued, snapshot()]
        finally:
            board.unsubscribe(client)

    return asyncio.run(play())
