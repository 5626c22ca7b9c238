"""``lifecycle serve``: SIGTERM drains a process of its own; bad input, called in this one."""

from __future__ import annotations

import json
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import Lifecycle
from tests.lifecycle.serving.command import metric, serving
from tests.lifecycle.serving.conftest import WATCHDOG_S, loopback_client
from tests.lifecycle.serving.file_gate import FileGate
from tests.lifecycle.serving.test_metrics import counted
from tests.processes import Program, start_python

pytestmark = pytest.mark.long


def accepted_jobs(metrics: str) -> int:
    """Return the jobs the worker holds: those in batches it started, and those queued."""
    started = metric(metrics, "lifecycle_batch_size_sum")
    return int(started + metric(metrics, "lifecycle_queue_depth"))


def disk_spec(root: Path, offload: Path) -> Path:
    """Write the reference spec offloading to disk under ``offload``; return its path.

    Its drain waits up to the watchdog: the drain test holds its requests at the gate
    through the start of the drain, which a loaded machine may stretch past the default
    30 s, and the test is about the drain, not its timeout.
    """
    text = (root / "examples" / "tiny_t2i.toml").read_text()
    text = text.replace(
        'offload_target = "host"', f'offload_target = "disk"\noffload_dir = "{offload}"'
    )
    spec = offload.parent / "t2i.toml"
    spec.write_text(text + f"\n[serving]\ndrain_timeout = {WATCHDOG_S}\n")
    return spec


def t2i_text(root: Path, name: str, transformer_seed: int, vae_backend: str = "") -> str:
    """Return the reference spec as ``name``, with that DiT seed and a VAE backend if any."""
    text = (root / "examples" / "tiny_t2i.toml").read_text()
    text = text.replace('name = "tiny-t2i"', f'name = "{name}"')
    text = text.replace(
        "packed_sequences = true", f"packed_sequences = true\nseed = {transformer_seed}"
    )
    if vae_backend:
        text = text.replace(
            'kind = "tiny_vae"', f'kind = "tiny_vae"\nattention_backend = "{vae_backend}"'
        )
    return text


def reloads(log: str) -> list[tuple[str, str]]:
    """Return each ``pipeline.reloaded`` event the worker logged: (pipeline, outcome)."""
    events = [json.loads(line) for line in log.splitlines() if '"pipeline.reloaded"' in line]
    return [(event["pipeline"], event["outcome"]) for event in events]


class TestReloadOnSighup:
    def test_a_refused_spec_changes_nothing_then_a_changed_one_swaps(
        self, root: Path, tmp_path: Path
    ) -> None:
        """SIGHUP re-reads every spec: one that check refuses leaves its pipeline serving as
        before; a valid changed one is swapped in; an unchanged one is left alone."""
        a, b = tmp_path / "a.toml", tmp_path / "b.toml"
        a.write_text(t2i_text(root, "a", 2))
        b.write_text(t2i_text(root, "b", 5))
        body = {"prompt": "a red fox", "seed": 7, "steps": 2}

        def images(client: httpx.Client) -> list[str]:
            answers = [
                client.post("/v1/images/generations", json={**body, "model": m}) for m in "ab"
            ]
            return [answer.json()["data"][0]["b64_json"] for answer in answers]

        def hang_up(program: Program, count: int) -> None:
            program.send_signal(signal.SIGHUP)
            for _ in range(int(WATCHDOG_S / 0.01)):
                if len(reloads(program.stderr())) >= count:
                    return
                threading.Event().wait(0.01)
            raise AssertionError(f"no reload logged: {program.stderr()[-2000:]}")

        with (
            serving(a, "--log-level", "info", more=(b,)) as (program, url),
            loopback_client(url) as client,
        ):
            before = images(client)
            a.write_text(t2i_text(root, "a", 2, vae_backend="flash_attn"))
            hang_up(program, 2)
            refused = images(client)
            a.write_text(t2i_text(root, "a", 9))
            hang_up(program, 4)
            swapped = images(client)
            states = {p["name"]: p["state"] for p in client.get("/v1/pipelines").json()["data"]}
            log = program.stderr()
        assert reloads(log) == [
            ("a", "refused"),
            ("b", "unchanged"),
            ("a", "swapped"),
            ("b", "unchanged"),
        ]
        assert refused == before
        assert swapped[0] != before[0]
        assert swapped[1] == before[1]
        assert states == {"a": "serving", "b": "serving"}


class TestShutdown:
    def test_sigterm_drains_in_flight_requests(
        self, root: Path, tmp_path: Path, file_gate: FileGate
    ) -> None:
        """SIGTERM under load: running requests complete, new ones get 503, exit 0, no files.

        The requests are held at the gate until the late one is refused. The worker logs
        at the default level: no move is logged, and /metrics counts them; stderr holds the
        ready and draining lines only.
        """
        offload = tmp_path / "offload"
        spec = disk_spec(root, offload)
        with serving(spec, path=file_gate.path) as (program, url):
            assert any(offload.rglob("*.safetensors"))  # the offloaded weights live on disk
            body = {"prompt": "a cat", "steps": 2, "size": "32x32", "seed": 1}
            body |= {"attention_backend": "file_gated"}  # held until the late one is refused
            with (
                loopback_client(url) as client,
                ThreadPoolExecutor(4) as pool,
            ):
                running = [
                    pool.submit(client.post, "/v1/images/generations", json=body) for _ in range(4)
                ]
                assert file_gate.reached(WATCHDOG_S), program.stderr()
                for _ in range(int(WATCHDOG_S / 0.01)):  # all four are in flight, none done
                    metrics = client.get("/metrics").text
                    if accepted_jobs(metrics) == len(running):
                        break
                    threading.Event().wait(0.01)
                else:
                    pytest.fail(f"the worker never held all four requests: {metrics}")
                program.send_signal(signal.SIGTERM)
                for _ in range(int(WATCHDOG_S / 0.01)):
                    if client.get("/readyz").status_code == 503:
                        break
                    threading.Event().wait(0.01)
                else:
                    pytest.fail(f"/readyz never turned 503 on SIGTERM: {program.stderr()[-2000:]}")
                refused = client.post("/v1/images/generations", json={"prompt": "late"})
                file_gate.open()
                answers = [future.result(timeout=WATCHDOG_S) for future in running]
            code, _, stderr = program.wait(timeout=WATCHDOG_S)
        assert [a.status_code for a in answers] == [200] * 4
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert code == 0, stderr
        assert not any(offload.rglob("*.safetensors"))
        # at the default level serve says two lines: ready (no keys, the page open), draining
        assert stderr.splitlines() == [
            f"lifecycle serve: ready on {url}, pipeline tiny-t2i; no API key, no admin key "
            f"(admin routes off); status page {url}/ (open)",
            "lifecycle serve: draining on SIGTERM: new requests get 503, the 4 requests queued "
            "or running finish first (within serving.drain_timeout); then every pipeline is "
            "released and it exits",
        ]
        # at the default level (warning) nothing logs a move, yet /metrics counted them
        assert "lifecycle.transition" not in stderr
        counts = counted(metrics)
        assert counts['lifecycle_transitions_total{trigger="onload"}'] > 0
        assert counts['lifecycle_moved_bytes_total{direction="onload"}'] > 0

    def test_sigterm_while_loading_drains(self, root: Path, tmp_path: Path) -> None:
        """``serve SPEC --log-level info`` starts; SIGTERM as it loads: exit 0, no files left."""
        offload = tmp_path / "offload"
        spec = disk_spec(root, offload)
        # the logging options after the subcommand, as for every other
        command = ("serve", spec, "--log-level", "info", "--port", "0")
        with start_python(
            "lifecycle", *command, "--threads", "1", cwd=tmp_path, module=True
        ) as program:
            listening = program.wait_for_line("serving.listening", WATCHDOG_S)
            program.send_signal(signal.SIGTERM)
            returncode, _, stderr = program.wait(timeout=WATCHDOG_S)
        assert returncode == 0, stderr
        assert '"threads":1' in listening
        assert "Traceback" not in stderr
        assert not any(offload.rglob("*.safetensors"))


class TestAnnounce:
    """At the default level ``serve`` says when it is ready (the drain test reads both of
    its lines whole)."""

    def test_ready_line_names_the_port_picked_and_says_the_page_is_behind_the_key(
        self, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``--port 0`` (``serving`` passes it) serves on a free port the system picks (it was
        exit 2): the ready line, its status page address and the serving.listening event
        name that port, which answers. With an API key the ready line says the key is set,
        never what it is, and that the status page is behind it (the door's own rule,
        ``auth.page_access``)."""
        key = "sk-announce-7f3a"
        monkeypatch.setenv("LIFECYCLE_API_KEY", key)
        spec = root / "examples" / "tiny_t2i.toml"
        with serving(spec, "--log-level", "info") as (program, url):
            ready = program.wait_for_line("lifecycle serve: ready", WATCHDOG_S)
            with loopback_client(url) as client:
                page = client.get("/").status_code  # the door agrees with the line
                readyz = client.get("/readyz").status_code
            stderr = program.stderr()
        port = int(url.rpartition(":")[2])
        events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
        (listening,) = [event for event in events if event["event"] == "serving.listening"]
        assert port != 0
        assert (listening["host"], listening["port"]) == ("127.0.0.1", port)
        assert (page, readyz) == (401, 200)
        assert ready.startswith(f"lifecycle serve: ready on http://127.0.0.1:{port}, ")
        assert "; API key set, no admin key (admin routes off); " in ready
        assert ready.endswith(f"status page http://127.0.0.1:{port}/ (behind the API key)\n")
        assert key not in stderr


class TestCommand:
    def test_threads_below_one_exit_2(self, root: Path, lifecycle: Lifecycle) -> None:
        """`lifecycle serve --threads 0` is bad input: exit 2 naming the rule, nothing starts."""
        result = lifecycle("serve", root / "examples" / "minilm_embed.toml", "--threads", "0")
        assert result.returncode == 2
        assert "--threads: expected a count >= 1, got 0" in result.stderr
        assert "Traceback" not in result.stderr

    def test_bad_spec_exits_2_and_refused_spec_exits_1(
        self, root: Path, tmp_path: Path, lifecycle: Lifecycle
    ) -> None:
        """A spec that does not decode exits 2; one admission refuses exits 1 with the reason."""
        bad = tmp_path / "bad.toml"
        bad.write_text('name = "x"\n[components.a]\nkind = "tiny_vae"\nresidency = "offlaod"\n')
        refused = root / "examples" / "refused" / "capability_missing.toml"
        # the address is bound before admission: one the system picks, so that admission decides
        results = [lifecycle("serve", spec, "--port", "0") for spec in (bad, refused)]
        assert [r.returncode for r in results] == [2, 1]
        assert "$.components.a.residency" in results[0].stderr
        assert "attention.capability_missing" in results[1].stderr
        assert all("Traceback" not in r.stderr for r in results)

    def test_serve_without_the_extra_names_it(
        self, root: Path, lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without fastapi, `lifecycle serve` exits 2 naming the serve extra, no traceback."""
        monkeypatch.setitem(sys.modules, "fastapi", None)  # what a failed import leaves
        result = lifecycle("serve", root / "examples" / "tiny_t2i.toml")
        assert result.returncode == 2
        assert "pipeline-lifecycle[serve]" in result.stderr
        assert "Traceback" not in result.stderr
