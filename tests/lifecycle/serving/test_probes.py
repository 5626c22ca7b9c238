"""``lifecycle serve`` as a process against what a probe found: huge bodies, bad ports, a
drain that outlives its timeout."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.conftest import Lifecycle
from tests.lifecycle.serving.command import serving
from tests.lifecycle.serving.conftest import WATCHDOG_S, loopback_client
from tests.lifecycle.serving.file_gate import FileGate
from tests.lifecycle.serving.test_process import accepted_jobs

pytestmark = pytest.mark.long  # serve processes: scheduled first on the xdist workers

MiB = 2**20
GROWTH_BOUND = 8 * MiB
"""The most a refused request may raise the worker's peak resident memory (measured: 0.4
MiB for a 50 MB body with its length, 2.2 MiB sent in chunks, 5.9 MiB for 100,000 inputs,
which are decoded before they are counted)."""


def memory(pid: int) -> dict[str, int]:
    """Return the process's resident bytes now (VmRSS) and at their peak (VmHWM)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0]) * 1024
    return found


def peak_growth(pid: int, send: Callable[[], bytes]) -> tuple[int, bytes]:
    """Run ``send``; return how far the process's peak resident bytes rose above its
    resident bytes meanwhile (the peak is reset first), and what ``send`` returned."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to VmRSS
    before = memory(pid)["VmRSS"]
    answer = send()
    return memory(pid)["VmHWM"] - before, answer


def raw_post(url: str, head: bytes, body: Iterable[bytes]) -> bytes:
    """POST ``head`` and as much of ``body`` as the server reads; return its answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WATCHDOG_S) as sock:
        sock.sendall(head)
        try:
            for chunk in body:
                sock.sendall(chunk)
        except OSError:  # the server answered and closed: the rest is never read
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


class TestHugeRequests:
    @pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
    def test_50_mb_bodies_and_100000_inputs_cost_a_few_mib(self, root: Path) -> None:
        """A 50 MB body (declared or chunked) is a 413, 100,000 inputs a 400: the worker's
        peak resident memory rises by less than 8 MiB for each (it rose by 6.8 GB)."""
        megabyte = b"x" * MiB
        head = b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        declared = head + b"content-length: 52428800\r\n\r\n"
        chunked = head + b"transfer-encoding: chunked\r\n\r\n"
        chunk = b"100000\r\n" + megabyte + b"\r\n"
        inputs = msgspec.json.encode({"input": [f"word {i}" for i in range(100_000)]})
        many = head + f"content-length: {len(inputs)}\r\nconnection: close\r\n\r\n".encode()
        spec = root / "examples" / "tiny_t2i.toml"
        with serving(spec) as (program, url):
            with loopback_client(url, timeout=5) as client:
                assert client.post("/v1/images/generations", json={"prompt": "a"}).is_success
            growth = [
                peak_growth(program.pid, lambda: raw_post(url, declared, [megabyte] * 50)),
                peak_growth(program.pid, lambda: raw_post(url, chunked, [chunk] * 50)),
                peak_growth(program.pid, lambda: raw_post(url, many, [inputs])),
            ]
        answers = [answer for _, answer in growth]
        assert [a[:13] for a in answers] == [b"HTTP/1.1 413 ", b"HTTP/1.1 413 ", b"HTTP/1.1 400 "]
        assert b'"limit":"serving.max_inputs"' in answers[2]
        assert all(grown < GROWTH_BOUND for grown, _ in growth), [g for g, _ in growth]


class TestPorts:
    @pytest.mark.parametrize(
        ("port", "words"), [("-1", "got -1"), ("70000", "got 70000"), ("x", "got 'x'")]
    )
    def test_a_port_out_of_range_exits_2(
        self, root: Path, lifecycle: Lifecycle, port: str, words: str
    ) -> None:
        """--port -1 or 70000 (which bound 4464) is bad input: exit 2 naming the range."""
        result = lifecycle("serve", root / "examples" / "tiny_t2i.toml", "--port", port)
        assert result.returncode == 2
        assert "--port: expected a port" in result.stderr
        assert words in result.stderr
        assert "Traceback" not in result.stderr

    def test_a_taken_port_exits_2_before_loading(self, root: Path, lifecycle: Lifecycle) -> None:
        """A port another socket holds is exit 2 naming the address (it was SIGABRT)."""
        spec = root / "examples" / "tiny_t2i.toml"
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            result = lifecycle("serve", spec, "--port", str(port), "--log-level", "info")
        assert result.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
        assert "lifecycle.transition" not in result.stderr  # nothing was admitted or loaded
        assert "Traceback" not in result.stderr

    def test_an_unknown_host_exits_2(self, root: Path, lifecycle: Lifecycle) -> None:
        """A host that does not resolve is exit 2 naming it."""
        spec = root / "examples" / "tiny_t2i.toml"
        result = lifecycle("serve", spec, "--host", "no-such-host.invalid", "--port", "0")
        assert result.returncode == 2
        assert "cannot listen on no-such-host.invalid:" in result.stderr
        assert "Traceback" not in result.stderr


class TestDrainTimeout:
    def test_a_drain_past_its_timeout_releases_the_rest_and_exits_3(
        self, root: Path, tmp_path: Path, file_gate: FileGate
    ) -> None:
        """A job outlives serving.drain_timeout: one SIGTERM ends the process with exit 3,
        the reason logged, the offload folder removed (it hung until a second signal, then
        exited 0). The job waits at a gate that never opens."""
        offload = tmp_path / "offload"
        spec = tmp_path / "t2i.toml"
        text = (root / "examples" / "tiny_t2i.toml").read_text()
        spec.write_text(
            text.replace(
                'offload_target = "host"', f'offload_target = "disk"\noffload_dir = "{offload}"'
            )
            + "\n[serving]\ndrain_timeout = 0.5\n"
        )
        with serving(spec, path=file_gate.path) as (program, url):
            body = {"prompt": "a cat", "steps": 1, "attention_backend": "file_gated"}
            with loopback_client(url) as client:
                endless = threading.Thread(
                    target=_post_ignoring_errors, args=(client, body), daemon=True
                )
                endless.start()
                assert file_gate.reached(WATCHDOG_S), program.stderr()
                for _ in range(int(WATCHDOG_S / 0.01)):  # the job runs
                    if accepted_jobs(client.get("/metrics").text) == 1:
                        break
                    threading.Event().wait(0.01)
                else:
                    pytest.fail(f"the worker never held the job: {program.stderr()[-2000:]}")
                program.send_signal(signal.SIGTERM)
                code, _, stderr = program.wait(timeout=WATCHDOG_S)
        assert code == 3
        assert '"event":"serving.drain_failed"' in stderr
        assert "1 job(s) still running after serving.drain_timeout = 0.5 s were abandoned" in stderr
        assert "is in use by request(s) req-" in stderr
        assert "Traceback" not in stderr
        assert not offload.exists() or not any(offload.rglob("*.safetensors"))


def _post_ignoring_errors(client: httpx.Client, body: dict[str, object]) -> None:
    """POST ``body``; the worker exits under it, so a dropped connection is expected."""
    with contextlib.suppress(httpx.TransportError):
        client.post("/v1/images/generations", json=body)
