"""Reading ``GET /v1/events`` in tests: a thread that parses server-sent events as they come."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.lifecycle.serving.conftest import WATCHDOG_S

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
        self._client = httpx.Client(base_url=url, timeout=httpx.Timeout(WATCHDOG_S, read=None))
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
