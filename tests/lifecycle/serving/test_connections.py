"""Connections: capped headers, bounded connections, slow headers and bodies timed out."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest

from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.serving.conftest import WATCHDOG_S, Served, ServeSpec, SharedT2i

SpecMaker = Callable[..., PipelineSpec]
HEADER_LIMIT = 1024


def connect(served: Served) -> socket.socket:
    """Open a raw connection to the worker."""
    host, port = served.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=WATCHDOG_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Read what the worker sends until it closes the connection (a reset counts as closed)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def head_of(size: int) -> bytes:
    """Return a GET /healthz request head of exactly ``size`` bytes (a padded header)."""
    start = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-pad: "
    end = b"\r\n\r\n"
    return start + b"p" * (size - len(start) - len(end)) + end


BOUNDS = {
    "max_header_bytes": HEADER_LIMIT,
    "header_timeout": 1.0,
    "body_timeout": 1.0,
    "max_connections": 4,
}
"""Small header, time and connection bounds."""

HURRIED = BOUNDS | {"header_timeout": 0.3, "body_timeout": 0.3}
"""``BOUNDS`` with short time limits, for the clients too slow to ever meet them: each test
waits a limit out, and the worker's connections time out the same at any length."""


@pytest.fixture
def guarded(shared_t2i: SharedT2i) -> Served:
    """The module's reference pipeline under ``BOUNDS``: each test's connections are
    closed by its end, the worker's own or the client's."""
    return shared_t2i(**BOUNDS)


@pytest.fixture
def hurried(shared_t2i: SharedT2i) -> Served:
    """The module's reference pipeline under ``HURRIED``."""
    return shared_t2i(**HURRIED)


@pytest.fixture
def alone(serve_spec: ServeSpec, t2i_spec: SpecMaker) -> Served:
    """The reference pipeline under ``BOUNDS`` in a worker of its own: a test that counts
    the worker's connections sees none of another test's that it has yet to notice
    closed."""
    return serve_spec(t2i_spec(**BOUNDS))


class TestHeaders:
    def test_headers_take_their_limit_and_refuse_one_byte_more(self, guarded: Served) -> None:
        """A head of exactly serving.max_header_bytes is served; one byte more is a 431 and
        the connection closes (8 MB heads were read whole)."""
        with connect(guarded) as sock:
            sock.sendall(head_of(HEADER_LIMIT))
            accepted = read_until_closed(sock)
        with connect(guarded) as sock:
            sock.sendall(head_of(HEADER_LIMIT + 1))
            refused = read_until_closed(sock)
        assert accepted.startswith(b"HTTP/1.1 200 ")
        assert refused.startswith(b"HTTP/1.1 431 ")
        assert b"serving.max_header_bytes = 1024 bytes" in refused

    def test_an_endless_header_is_cut_at_the_limit(self, guarded: Served) -> None:
        """Headers streamed without end are answered 431 once past the limit, not buffered."""
        with connect(guarded) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nx-endless: ")
            try:
                for _ in range(1000):
                    sock.sendall(b"a" * 1024)
            except OSError:  # closed by the worker
                pass
            answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 431 ")

    def test_a_request_after_a_response_has_its_own_budget(self, guarded: Served) -> None:
        """On a kept-alive connection each request's head is counted afresh."""
        request = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: " + b"p" * 600 + b"\r\n\r\n"
        with connect(guarded) as sock:
            answers = []
            for _ in range(3):
                sock.sendall(request)
                answers.append(sock.recv(65536))
        assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers)


class TestSlowClients:
    def test_a_slowloris_client_is_closed(self, hurried: Served) -> None:
        """A client that trickles its headers a byte at a time is answered 408 and closed
        after serving.header_timeout (it was never closed)."""
        stop = threading.Event()
        with connect(hurried) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")

            def trickle() -> None:
                try:
                    while not stop.wait(0.1):
                        sock.sendall(b"x")
                except OSError:  # closed by the worker
                    pass

            sender = threading.Thread(target=trickle, daemon=True)
            sender.start()
            answer = read_until_closed(sock)
            stop.set()
            sender.join(timeout=WATCHDOG_S)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b"serving.header_timeout = 0.3 s" in answer

    def test_a_silent_connection_is_closed(self, hurried: Served) -> None:
        """A connection that never sends a byte is closed after serving.header_timeout."""
        with connect(hurried) as sock:
            answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 408 ")

    def test_a_slow_body_is_cut(self, hurried: Served) -> None:
        """A body that does not arrive within serving.body_timeout closes the connection."""
        with connect(hurried) as sock:
            sock.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
            )
            answer = read_until_closed(sock)
        assert not answer.startswith(b"HTTP/1.1 200")
        with hurried.client() as client:  # the worker serves on
            assert client.get("/healthz").status_code == 200


class TestConnections:
    def test_connections_beyond_the_limit_are_refused_at_once(self, alone: Served) -> None:
        """With serving.max_connections open, one more is answered 503 and closed; once
        they close, connections are taken again."""
        held = [connect(alone) for _ in range(4)]
        try:
            for sock in held:  # each is accepted and its request served
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            with connect(alone) as extra:
                refused = read_until_closed(extra)
        finally:
            for sock in held:
                sock.close()
        assert refused.startswith(b"HTTP/1.1 503 ")
        assert b"serving.max_connections = 4" in refused
        with alone.client() as client:
            for _ in range(int(WATCHDOG_S / 0.05)):  # the worker notices the closes
                if client.get("/healthz").status_code == 200:
                    break
                threading.Event().wait(0.05)
            assert client.get("/healthz").status_code == 200
