"""Cancelling requests over HTTP (design §15): a client that disconnects, ``DELETE
/v1/requests/{id}``, a ``timeout``; request ids; ``GET /v1/requests/{id}``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from torch import nn

from lifecycle.events import RequestCancelled
from lifecycle.serving.batcher import Batcher
from lifecycle.serving.jobs import OUTPUT_TOLERANCE, BatchKey, Job, JobCancelled
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec
from lifecycle.testing import EventRecorder
from tests.conftest import decode_png
from tests.lifecycle.serving.conftest import WATCHDOG_S, Served, ServeSpec, SharedT2i, run_alone
from tests.lifecycle.test_waiting import until

SpecMaker = Callable[..., PipelineSpec]

SLOW = BatchKey(endpoint="images", steps=1000, latent_size=(8, 8))
"""A job that runs long enough to be cancelled halfway, whatever the machine."""


def generate(client: httpx.Client, request_id: str | None = None, **body: Any) -> httpx.Response:
    """POST an image generation request, with ``x-request-id`` when given."""
    headers = {} if request_id is None else {"x-request-id": request_id}
    return client.post(
        "/v1/images/generations", json={"prompt": "a red fox", **body}, headers=headers
    )


def pixels(response: httpx.Response) -> Any:
    """Return the first image of an images answer as pixels ``(H, W, 3)``."""
    return decode_png(base64.b64decode(response.json()["data"][0]["b64_json"]))


def expected_pixels(served: Served, seed: int, steps: int) -> Any:
    """Return the pixels a fresh run through the embedded API makes for that request."""
    key = BatchKey(endpoint="images", steps=steps, latent_size=(4, 4))
    job = Job(id=f"fresh-{seed}", key=key, prompts=["a red fox"], tokens=16, seed=seed)
    image = run_alone(served.worker, job)[0]
    return ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0)


def at_rest(served: Served) -> bool:
    """Tell whether nothing is queued, running or in use."""
    batcher = served.worker.batcher
    assert batcher is not None
    orchestrator = served.worker.orchestrator
    return (
        batcher.in_flight == 0
        and batcher.depth == 0
        and all(orchestrator.component(n).in_use_by == () for n in ("text_encoder", "vae"))
        and orchestrator.component("transformer").in_use_by == ()
    )


def occupy_runners(batcher: Batcher, count: int = 2) -> list[Future[Job]]:
    """Start ``count`` slow jobs of different keys: with two, the next jobs stay queued;
    with one, they gather for their batch window while it runs."""
    keys = [SLOW, BatchKey(endpoint="images", steps=1000, latent_size=(8, 4))][:count]
    futures = [
        batcher.submit(Job(id=f"slow-{i}", key=key, prompts=["slow"], tokens=64))
        for i, key in enumerate(keys)
    ]
    until(lambda: batcher.depth == 0 and batcher.in_flight == count)
    return futures


def release(batcher: Batcher, slow: list[Future[Job]]) -> None:
    """Cancel the slow jobs of ``occupy_runners`` and wait until they are gone."""
    for i in range(len(slow)):
        batcher.cancel(f"slow-{i}", "deleted")
    until(lambda: batcher.in_flight == 0)


class TestDisconnect:
    def test_disconnect_stops_within_one_step_and_leaves_nothing(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """A client that goes away mid-request stops it within a step; all returns to idle,
        and the next request's image equals a fresh run's."""
        served = serve_spec(t2i_spec(max_steps=1000))  # serving.max_steps: 200 by default
        observed = EventRecorder()
        served.worker.orchestrator.observe(observed)
        idle_bytes = served.worker.orchestrator.resident_bytes()

        async def disconnect_midway() -> None:
            async with httpx.AsyncClient(
                base_url=served.url, timeout=WATCHDOG_S, verify=False
            ) as client:
                body = {"prompt": "a red fox", "steps": 1000, "size": "32x32"}
                headers = {"x-request-id": "gone-1"}
                post = asyncio.create_task(
                    client.post("/v1/images/generations", json=body, headers=headers)
                )
                for _ in range(int(WATCHDOG_S / 0.005)):
                    status = (await client.get("/v1/requests/gone-1")).json()
                    if status.get("state") == "running" and status["step"] >= 2:
                        break
                    await asyncio.sleep(0.005)
                post.cancel()  # httpx closes the connection: the client is gone
                with contextlib.suppress(asyncio.CancelledError):
                    await post

        asyncio.run(disconnect_midway())
        until(lambda: at_rest(served))
        assert served.worker.orchestrator.resident_bytes() == idle_bytes
        with served.client() as client:
            status = client.get("/v1/requests/gone-1").json()
            assert status["state"] == "cancelled"
            assert status["stage"] == "denoise"
            (stopped,) = [e for e in observed.of(RequestCancelled) if e.request_id == "gone-1"]
            assert stopped.stage == "denoise"
            assert status["step"] <= stopped.step <= status["step"] + 1  # within one step
            after = generate(client, steps=2, seed=5)
        assert after.status_code == 200
        assert (pixels(after).int() - expected_pixels(served, 5, 2).int()).abs().max() <= 1
        metrics = served.get("/metrics").text
        assert 'lifecycle_cancelled_requests_total{stage="denoise"} 1.0' in metrics


class TestBatchMember:
    def test_cancelling_one_of_four_leaves_the_others_unchanged(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """One job of a batch of 4 cancelled at step 2: the other 3 equal their solo runs."""
        served = serve_spec(t2i_spec(batch_window_ms=WATCHDOG_S * 1e3, max_batch=4))
        batcher = served.worker.batcher
        assert batcher is not None
        observed = EventRecorder()
        served.worker.orchestrator.observe(observed)
        key = BatchKey(endpoint="images", steps=5, latent_size=(4, 4))
        reached, go = threading.Event(), threading.Event()

        def pause(step: int, steps: int, latents: list[Any]) -> None:
            if step == 2:
                reached.set()
                assert go.wait(WATCHDOG_S)

        jobs = [
            Job(id=f"m{i}", key=key, prompts=["a fox"] * (1 + i % 2), tokens=16, seed=i)
            for i in range(4)
        ]
        jobs[0].on_step = pause
        slow = occupy_runners(batcher, 1)  # the four gather into one batch meanwhile
        futures = [batcher.submit(job) for job in jobs]
        assert reached.wait(WATCHDOG_S)
        status = batcher.cancel("m2", "deleted")
        go.set()
        assert status is not None
        assert (status.state, status.step) == ("cancelled", 2)
        with pytest.raises(JobCancelled, match="'m2' was cancelled"):
            futures[2].result(timeout=WATCHDOG_S)
        done = [futures[i].result(timeout=WATCHDOG_S) for i in (0, 1, 3)]
        release(batcher, slow)
        assert {job.batch_size for job in done} == {4}
        for job in done:
            assert job.output is not None
            solo = Job(id=f"solo-{job.id}", key=key, prompts=job.prompts, tokens=16, seed=job.seed)
            assert (job.output - run_alone(served.worker, solo)).abs().max() <= OUTPUT_TOLERANCE
        (stopped,) = [e for e in observed.of(RequestCancelled) if e.request_id == "m2"]
        assert (stopped.stage, stopped.step) == ("denoise", 2)


class TestDelete:
    def test_delete_takes_a_queued_request_out_at_once(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """DELETE on a queued request removes it from the queue before it answers."""
        served = serve_spec(t2i_spec())
        batcher = served.worker.batcher
        assert batcher is not None
        slow = occupy_runners(batcher)
        with served.client() as client, ThreadPoolExecutor(1) as pool:
            posted = pool.submit(generate, served.client(), "queued-1", steps=1)
            until(lambda: batcher.depth == 1)
            queued = client.get("/v1/requests/queued-1").json()
            deleted = client.delete("/v1/requests/queued-1")
            depth = batcher.depth
            answer = posted.result(timeout=WATCHDOG_S)
            missing = client.delete("/v1/requests/never-sent")
        release(batcher, slow)
        assert queued == {
            "id": "queued-1",
            "state": "queued",
            "stage": None,
            "step": 0,
            "steps": 1,
            "queue_position": 0,
        }
        assert deleted.status_code == 200
        assert deleted.json()["state"] == "cancelled"
        assert depth == 0
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "request_cancelled"
        assert answer.headers["x-request-id"] == "queued-1"
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "request_not_found"
        metrics = served.get("/metrics").text
        assert 'lifecycle_cancelled_requests_total{stage="queued"} 1.0' in metrics

    def test_delete_of_a_finished_request_is_409(self, shared_t2i: SharedT2i) -> None:
        """A request that is done cannot be cancelled; GET still says where it ended."""
        served = shared_t2i()
        with served.client() as client:
            assert generate(client, "done-1", steps=2).status_code == 200
            status = client.get("/v1/requests/done-1").json()
            deleted = client.delete("/v1/requests/done-1")
        assert status == {
            "id": "done-1",
            "state": "done",
            "stage": "decode",
            "step": 0,
            "steps": 2,
            "queue_position": None,
        }
        assert deleted.status_code == 409
        assert deleted.json()["error"]["code"] == "request_done"


class TestTimeout:
    def test_request_past_its_timeout_is_504_and_leaves(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """A request still queued at its timeout is cancelled: 504, and the queue empties."""
        served = serve_spec(t2i_spec())
        batcher = served.worker.batcher
        assert batcher is not None
        slow = occupy_runners(batcher)
        with served.client() as client:
            response = generate(client, "late-1", steps=1, timeout=0.05)
            depth = batcher.depth
        release(batcher, slow)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "request_timeout"
        assert depth == 0

    def test_timeout_above_the_limit_is_400(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """A timeout above serving.max_request_seconds is refused, naming the key."""
        served = serve_spec(t2i_spec(max_request_seconds=5))
        with served.client() as client:
            response = generate(client, steps=1, timeout=6)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "timeout"
        assert "serving.max_request_seconds = 5" in error["message"]


class TestRequestIds:
    def test_client_id_is_honoured_and_unique_among_live_requests(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """The client's x-request-id names the request; a live duplicate is 409."""
        served = serve_spec(t2i_spec())
        batcher = served.worker.batcher
        assert batcher is not None
        slow = occupy_runners(batcher)
        with served.client() as client, ThreadPoolExecutor(1) as pool:
            first = pool.submit(generate, served.client(), "trace:a.1-b", steps=1)
            until(lambda: batcher.depth == 1)
            again = generate(client, "trace:a.1-b", steps=1)
            release(batcher, slow)
            answered = first.result(timeout=WATCHDOG_S)
        assert answered.status_code == 200
        assert answered.headers["x-request-id"] == "trace:a.1-b"
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "duplicate_request_id"

    @pytest.mark.parametrize("sent", ["", "has space", "x" * 129, "semi;colon"])
    def test_malformed_id_is_400(self, shared_t2i: SharedT2i, sent: str) -> None:
        """An x-request-id outside 1-128 characters of [A-Za-z0-9._:-] is refused."""
        served = shared_t2i()
        with served.client() as client:
            response = generate(client, sent, steps=1)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_request_id"

    def test_assigned_ids_are_fresh_and_unguessable(self, shared_t2i: SharedT2i) -> None:
        """Without a header the worker assigns req-N- and 12 random hex digits, never twice."""
        served = shared_t2i()
        with served.client() as client:
            ids = [client.get("/healthz").headers["x-request-id"] for _ in range(3)]
        assert all(re.fullmatch(r"req-\d+-[0-9a-f]{12}", rid) for rid in ids)
        assert len(set(ids)) == 3


class EncoderGate:
    """Holds every forward of a served text encoder (a micro-batch each) until the test opens
    it, counting those that start and end, and the rows of each.

    Args:
        module: the encoder's module.
    """

    def __init__(self, module: nn.Module) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.started = 0
        self.ended = 0
        self.rows: list[int] = []
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._end)

    def _start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.started += 1
        self.rows.append(int(args[0].shape[0]))
        self.reached.set()
        assert self.opened.wait(WATCHDOG_S)

    def _end(self, *_: Any) -> None:
        self.ended += 1


EMBEDDINGS = [f"sentence {i} of a large request about a red fox" for i in range(512)]
"""A request of 512 inputs: several micro-batches of the encoder."""


def embed(served: Served, request_id: str) -> httpx.Response:
    """POST ``EMBEDDINGS`` as request ``request_id`` on a client of its own."""
    with served.client() as client:
        return client.post(
            "/v1/embeddings", json={"input": EMBEDDINGS}, headers={"x-request-id": request_id}
        )


class TestEmbeddings:
    """A large embeddings request stops within one micro-batch of its cancel (a 2048-input
    job whose client left ran 3.9 s more: its one forward ended first)."""

    @pytest.fixture
    def minilm(self, serve_spec: ServeSpec, root: Path) -> Served:
        """A worker of its own serving examples/minilm_embed.toml."""
        pytest.importorskip("tokenizers")
        return serve_spec(load_spec(root / "examples" / "minilm_embed.toml"))

    def stopped(self, served: Served, gate: EncoderGate, request_id: str) -> RequestCancelled:
        """Open the gate, wait until the worker is idle; return the request's cancel event."""
        observed = EventRecorder()
        served.worker.orchestrator.observe(observed)
        gate.opened.set()
        batcher = served.worker.batcher
        assert batcher is not None
        until(lambda: batcher.in_flight == 0)
        (stopped,) = [e for e in observed.of(RequestCancelled) if e.request_id == request_id]
        return stopped

    def test_delete_stops_it_after_the_micro_batch_in_flight(self, minilm: Served) -> None:
        """DELETE while the first micro-batch runs: it is the last one computed, and
        request.cancelled (stage encode) follows it."""
        gate = EncoderGate(minilm.worker.orchestrator.module("text_encoder"))
        with ThreadPoolExecutor(1) as pool, minilm.client() as client:
            posted = pool.submit(embed, minilm, "big-1")
            assert gate.reached.wait(WATCHDOG_S)
            deleted = client.delete("/v1/requests/big-1")
            started, ended = gate.started, gate.ended
            stopped = self.stopped(minilm, gate, "big-1")
            answer = posted.result(timeout=WATCHDOG_S)
        assert deleted.json()["state"] == "cancelled"
        assert answer.json()["error"]["code"] == "request_cancelled"
        assert stopped.stage == "encode"
        assert (started, ended) == (1, 0)  # the cancel came during the first micro-batch
        assert gate.started == started  # none started after it
        assert gate.ended - ended <= 1  # the one in flight ended
        assert gate.rows[0] < len(EMBEDDINGS)  # and it was a micro-batch, not the request

    def test_a_client_that_leaves_stops_it_after_the_micro_batch_in_flight(
        self, minilm: Served
    ) -> None:
        """A client that disconnects while the first micro-batch runs: it is the last one
        computed, and request.cancelled (stage encode) follows it."""
        gate = EncoderGate(minilm.worker.orchestrator.module("text_encoder"))

        async def leave_midway() -> tuple[int, int]:
            async with httpx.AsyncClient(
                base_url=minilm.url, timeout=WATCHDOG_S, verify=False
            ) as client:
                post = asyncio.create_task(
                    client.post(
                        "/v1/embeddings",
                        json={"input": EMBEDDINGS},
                        headers={"x-request-id": "big-2"},
                    )
                )
                assert await asyncio.to_thread(gate.reached.wait, WATCHDOG_S)
                post.cancel()  # httpx closes the connection: the client is gone
                with contextlib.suppress(asyncio.CancelledError):
                    await post
                for _ in range(int(WATCHDOG_S / 0.005)):  # until the worker noticed
                    status = (await client.get("/v1/requests/big-2")).json()
                    if status["state"] == "cancelled":
                        break
                    await asyncio.sleep(0.005)
                return gate.started, gate.ended

        started, ended = asyncio.run(leave_midway())
        stopped = self.stopped(minilm, gate, "big-2")
        assert stopped.stage == "encode"
        assert (started, ended) == (1, 0)
        assert gate.started == started
        assert gate.ended - ended <= 1
        assert gate.rows[0] < len(EMBEDDINGS)
