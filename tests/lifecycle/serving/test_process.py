"""``lifecycle serve``: SIGTERM drains a process of its own; bad input, called in this one."""

from __future__ import annotations

import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import Lifecycle
from tests.lifecycle.serving.command import free_port, metric, serving
from tests.lifecycle.serving.conftest import WATCHDOG_S
from tests.lifecycle.serving.test_metrics import counted
from tests.processes import start_python

pytestmark = pytest.mark.long


def accepted_jobs(metrics: str) -> int:
    """Return the jobs the worker holds: those in batches it started, and those queued."""
    started = metric(metrics, "lifecycle_batch_size_sum")
    return int(started + metric(metrics, "lifecycle_queue_depth"))


def disk_spec(root: Path, offload: Path) -> Path:
    """Write the reference spec offloading to disk under ``offload``; return its path.

    Its drain waits up to the watchdog: on a loaded machine the four long requests of
    the drain test outlast the default 30 s, and the test is about the drain, not its
    timeout.
    """
    text = (root / "examples" / "tiny_t2i.toml").read_text()
    text = text.replace(
        'offload_target = "host"', f'offload_target = "disk"\noffload_dir = "{offload}"'
    )
    spec = offload.parent / "t2i.toml"
    spec.write_text(text + f"\n[serving]\ndrain_timeout = {WATCHDOG_S}\n")
    return spec


class TestShutdown:
    def test_sigterm_drains_in_flight_requests(self, root: Path, tmp_path: Path) -> None:
        """SIGTERM under load: running requests complete, new ones get 503, exit 0, no files.

        The worker logs at the default level: no move is logged, and /metrics counts them.
        """
        offload = tmp_path / "offload"
        spec = disk_spec(root, offload)
        with serving(spec) as (program, url):
            assert any(offload.rglob("*.safetensors"))  # the offloaded weights live on disk
            body = {"prompt": "a cat", "steps": 600, "size": "32x32", "seed": 1}
            with (
                httpx.Client(base_url=url, timeout=WATCHDOG_S) as client,
                ThreadPoolExecutor(4) as pool,
            ):
                running = [
                    pool.submit(client.post, "/v1/images/generations", json=body) for _ in range(4)
                ]
                for _ in range(int(WATCHDOG_S / 0.01)):  # all four are in flight, none done
                    metrics = client.get("/metrics").text
                    if accepted_jobs(metrics) == len(running):
                        break
                    threading.Event().wait(0.01)
                program.send_signal(signal.SIGTERM)
                for _ in range(int(WATCHDOG_S / 0.01)):
                    if client.get("/readyz").status_code == 503:
                        break
                    threading.Event().wait(0.01)
                refused = client.post("/v1/images/generations", json={"prompt": "late"})
                answers = [future.result(timeout=WATCHDOG_S) for future in running]
            code, _, stderr = program.wait(timeout=WATCHDOG_S)
        assert [a.status_code for a in answers] == [200] * 4
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert code == 0, stderr
        assert not any(offload.rglob("*.safetensors"))
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
        command = ("serve", spec, "--log-level", "info", "--port", str(free_port()))
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
        results = [lifecycle("serve", spec, "--port", "1") for spec in (bad, refused)]
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
