"""``lifecycle serve`` as a process: the openai client, SIGTERM drain, the optional extra."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from components.batch import Batch
from lifecycle.orchestrator import Orchestrator
from tests.lifecycle.serving.conftest import WATCHDOG_S, decode_png
from tests.lifecycle.serving.test_metrics import counted

openai = pytest.importorskip("openai")

SENTENCES = ["A red fox leaps over a snowy fence.", "Ramen with a soft-boiled egg.", "Hi"]


def free_port() -> int:
    """Return a loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serving(spec: Path, log: Path, *more: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``lifecycle serve spec *more`` on a free loopback port until it is ready; kill it
    after."""
    port = free_port()
    with log.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "serve", str(spec), *more, "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(int(WATCHDOG_S / 0.1)):
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            threading.Event().wait(0.1)
        else:
            raise AssertionError("the worker never became ready")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WATCHDOG_S)


def metric(metrics: str, name: str) -> float:
    """Return the sample ``name`` (without labels) from a worker's Prometheus text, else 0."""
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def accepted_jobs(metrics: str) -> int:
    """Return the jobs the worker holds: those in batches it started, and those queued."""
    started = metric(metrics, "lifecycle_batch_size_sum")
    return int(started + metric(metrics, "lifecycle_queue_depth"))


class TestOpenAiClient:
    def test_embeddings_equal_the_embedded_api(self, root: Path, tmp_path: Path) -> None:
        """client.embeddings.create returns the vectors the Python API computes."""
        pytest.importorskip("tokenizers")
        spec = root / "examples" / "minilm_embed.toml"
        with Orchestrator.from_file(spec) as orch:
            orch.load()
            batch = Batch(generator=torch.Generator(), prompts=SENTENCES, size=len(SENTENCES))
            with orch.request() as request:
                request.run("encode", batch)
            assert batch.sentence_embeddings is not None
            expected = batch.sentence_embeddings
        with serving(spec, tmp_path / "serve.log") as (_, url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            response = client.embeddings.create(model="minilm-embed", input=SENTENCES)
            floats = client.embeddings.create(
                model="minilm-embed", input=SENTENCES[0], encoding_format="float"
            )
        got = torch.tensor([item.embedding for item in response.data])
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-5)
        assert torch.allclose(torch.tensor(floats.data[0].embedding), expected[0], atol=1e-5)
        assert response.usage.prompt_tokens > len(SENTENCES)

    def test_images_generate_returns_a_png_of_the_size(self, root: Path, tmp_path: Path) -> None:
        """client.images.generate returns n PNGs of the declared size; /metrics counts its moves
        while the worker logs at the default level, warning."""
        spec = root / "examples" / "tiny_t2i.toml"
        with serving(spec, tmp_path / "serve.log") as (_, url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            response = client.images.generate(
                model="tiny-t2i",
                prompt="a lighthouse in a storm",
                n=2,
                size="32x16",  # type: ignore[arg-type]  # this pipeline's sizes are small
                response_format="b64_json",
                extra_body={"seed": 3, "steps": 2},
            )
            assert response.data is not None
            images = [decode_png(base64.b64decode(d.b64_json or "")) for d in response.data]
            metrics = httpx.get(url + "/metrics").text
        assert [tuple(image.shape) for image in images] == [(16, 32, 3)] * 2
        counts = counted(metrics)
        assert counts["lifecycle_pipeline_request_seconds_count"] == 2  # the warm-up, the request
        assert counts['lifecycle_transitions_total{trigger="onload"}'] > 0
        assert counts['lifecycle_moved_bytes_total{direction="onload"}'] > 0
        assert "lifecycle.transition" not in (tmp_path / "serve.log").read_text()


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


def reloads(log: Path) -> list[tuple[str, str]]:
    """Return each ``pipeline.reloaded`` event the worker logged: (pipeline, outcome)."""
    events = [
        json.loads(line) for line in log.read_text().splitlines() if '"pipeline.reloaded"' in line
    ]
    return [(event["pipeline"], event["outcome"]) for event in events]


class TestReloadOnSighup:
    def test_a_refused_spec_changes_nothing_then_a_changed_one_swaps(
        self, root: Path, tmp_path: Path
    ) -> None:
        """SIGHUP re-reads every spec: one that check refuses leaves its pipeline serving as
        before; a valid changed one is swapped in; an unchanged one is left alone."""
        a, b, log = tmp_path / "a.toml", tmp_path / "b.toml", tmp_path / "serve.log"
        a.write_text(t2i_text(root, "a", 2))
        b.write_text(t2i_text(root, "b", 5))
        body = {"prompt": "a red fox", "seed": 7, "steps": 2}

        def images(client: httpx.Client) -> tuple[str, str]:
            return tuple(  # type: ignore[return-value]
                client.post("/v1/images/generations", json={**body, "model": m}).json()["data"][0][
                    "b64_json"
                ]
                for m in ("a", "b")
            )

        def hang_up(process: subprocess.Popen[bytes], count: int) -> None:
            process.send_signal(signal.SIGHUP)
            for _ in range(int(WATCHDOG_S / 0.01)):
                if len(reloads(log)) >= count:
                    return
                threading.Event().wait(0.01)
            raise AssertionError(f"no reload logged: {log.read_text()[-2000:]}")

        with (
            serving(a, log, str(b), "--log-level", "info") as (process, url),
            httpx.Client(base_url=url, timeout=WATCHDOG_S) as client,
        ):
            before = images(client)
            a.write_text(t2i_text(root, "a", 2, vae_backend="flash_attn"))
            hang_up(process, 2)
            refused = images(client)
            a.write_text(t2i_text(root, "a", 9))
            hang_up(process, 4)
            swapped = images(client)
            states = {p["name"]: p["state"] for p in client.get("/v1/pipelines").json()["data"]}
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
    def test_sigterm_drains_in_flight_requests(self, root: Path, tmp_path: Path) -> None:
        """SIGTERM under load: running requests complete, new ones get 503, exit 0, no files."""
        offload = tmp_path / "offload"
        spec = tmp_path / "t2i.toml"
        text = (root / "examples" / "tiny_t2i.toml").read_text()
        spec.write_text(
            text.replace(
                'offload_target = "host"',
                f'offload_target = "disk"\noffload_dir = "{offload}"',
            )
        )
        with serving(spec, tmp_path / "serve.log") as (process, url):
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
                    if accepted_jobs(client.get("/metrics").text) == len(running):
                        break
                    threading.Event().wait(0.01)
                process.send_signal(signal.SIGTERM)
                for _ in range(int(WATCHDOG_S / 0.01)):
                    if client.get("/readyz").status_code == 503:
                        break
                    threading.Event().wait(0.01)
                refused = client.post("/v1/images/generations", json={"prompt": "late"})
                answers = [future.result(timeout=WATCHDOG_S) for future in running]
            code = process.wait(timeout=WATCHDOG_S)
        assert [a.status_code for a in answers] == [200] * 4
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert code == 0
        assert not any(offload.rglob("*.safetensors"))

    def test_sigterm_while_loading_drains(self, root: Path, tmp_path: Path) -> None:
        """``serve SPEC --log-level info`` starts; SIGTERM as it loads: exit 0, no files left."""
        offload = tmp_path / "offload"
        spec = tmp_path / "t2i.toml"
        text = (root / "examples" / "tiny_t2i.toml").read_text()
        spec.write_text(
            text.replace(
                'offload_target = "host"',
                f'offload_target = "disk"\noffload_dir = "{offload}"',
            )
        )
        # the logging options after the subcommand, as for every other
        command = [sys.executable, "-m", "lifecycle", "serve", str(spec), "--log-level", "info"]
        with subprocess.Popen(
            [*command, "--port", str(free_port()), "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as process:
            try:
                assert process.stderr is not None
                listening = next(line for line in process.stderr if "serving.listening" in line)
                process.send_signal(signal.SIGTERM)
                _, stderr = process.communicate(timeout=WATCHDOG_S)
            finally:
                process.kill()
        assert process.returncode == 0, stderr
        assert '"threads":1' in listening
        assert "Traceback" not in stderr
        assert not any(offload.rglob("*.safetensors"))


class TestCommand:
    def test_threads_below_one_exit_2(self, root: Path) -> None:
        """`lifecycle serve --threads 0` is bad input: exit 2 naming the rule, nothing starts."""
        spec = root / "examples" / "minilm_embed.toml"
        result = subprocess.run(
            [sys.executable, "-m", "lifecycle", "serve", str(spec), "--threads", "0"],
            capture_output=True,
            text=True,
            timeout=WATCHDOG_S,
        )
        assert result.returncode == 2
        assert "--threads: expected a count >= 1, got 0" in result.stderr
        assert "Traceback" not in result.stderr

    def test_bad_spec_exits_2_and_refused_spec_exits_1(self, root: Path, tmp_path: Path) -> None:
        """A spec that does not decode exits 2; one admission refuses exits 1 with the reason."""
        bad = tmp_path / "bad.toml"
        bad.write_text('name = "x"\n[components.a]\nkind = "tiny_vae"\nresidency = "offlaod"\n')
        refused = root / "examples" / "refused" / "capability_missing.toml"
        results = [
            subprocess.run(
                [sys.executable, "-m", "lifecycle", "serve", str(spec), "--port", "1"],
                capture_output=True,
                text=True,
                timeout=WATCHDOG_S,
            )
            for spec in (bad, refused)
        ]
        assert [r.returncode for r in results] == [2, 1]
        assert "$.components.a.residency" in results[0].stderr
        assert "attention.capability_missing" in results[1].stderr
        assert all("Traceback" not in r.stderr for r in results)

    def test_serve_without_the_extra_names_it(self, root: Path) -> None:
        """Without fastapi, `lifecycle serve` exits 2 naming the serve extra, no traceback."""
        script = (
            "import sys; sys.modules['fastapi'] = None; from lifecycle.cli import main; "
            f"sys.exit(main(['serve', {str(root / 'examples' / 'tiny_t2i.toml')!r}]))"
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=WATCHDOG_S
        )
        assert result.returncode == 2
        assert "pipeline-lifecycle[serve]" in result.stderr
        assert "Traceback" not in result.stderr
