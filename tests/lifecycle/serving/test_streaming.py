"""``stream: true`` on image generation (design §15): server-sent events of every denoising
step, in OpenAI's image streaming shapes, read with an SSE client library."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import httpx
from httpx_sse import connect_sse

from lifecycle.events import RequestCancelled
from lifecycle.serving.streaming import preview_steps
from lifecycle.spec.structs import PipelineSpec
from lifecycle.testing import EventRecorder
from tests.conftest import decode_png
from tests.lifecycle.serving.conftest import ServeSpec, SharedT2i
from tests.lifecycle.serving.test_cancelling import at_rest
from tests.lifecycle.test_waiting import until

SpecMaker = Callable[..., PipelineSpec]

BODY = {"prompt": "a red fox", "steps": 4, "seed": 9, "size": "32x32"}


def stream(client: httpx.Client, **body: Any) -> tuple[httpx.Response, list[tuple[str, Any]]]:
    """POST a streamed image request; return the response and every (event, data) pair."""
    with connect_sse(
        client, "POST", "/v1/images/generations", json={**BODY, "stream": True, **body}
    ) as source:
        return source.response, [(sse.event, sse.json()) for sse in source.iter_sse()]


class TestStream:
    def test_every_step_then_the_same_image_as_without_streaming(
        self, shared_t2i: SharedT2i
    ) -> None:
        """One partial_image event per step (two with previews), then the non-streamed image."""
        served = shared_t2i()
        with served.client() as client:
            response, events = stream(client, partial_images=2)
            plain = client.post("/v1/images/generations", json=BODY)
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"].startswith("req-")
        kinds = [kind for kind, _ in events]
        assert kinds == ["image_generation.partial_image"] * 4 + ["image_generation.completed"]
        partials = [data for _, data in events[:4]]
        assert [(p["step"], p["total"], p["type"]) for p in partials] == [
            (step, 4, "image_generation.partial_image") for step in (1, 2, 3, 4)
        ]
        elapsed = [p["elapsed"] for p in partials]
        assert elapsed == sorted(elapsed)
        previews = [p for p in partials if "b64_json" in p]
        assert [(p["step"], p["partial_image_index"]) for p in previews] == [(1, 0), (2, 1)]
        preview = decode_png(base64.b64decode(previews[0]["b64_json"]))
        assert preview.shape == (32, 32, 3)
        completed = events[4][1]
        assert completed["size"] == "32x32"
        assert completed["output_format"] == "png"
        assert completed["b64_json"] == plain.json()["data"][0]["b64_json"]

    def test_leaving_the_stream_cancels_the_request(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """A client that stops reading after step 3 cancels the request within a step."""
        served = serve_spec(t2i_spec(max_steps=1000))  # serving.max_steps: 200 by default
        observed = EventRecorder()
        served.worker.orchestrator.observe(observed)
        body = {**BODY, "steps": 1000, "stream": True}
        headers = {"x-request-id": "watcher-1"}
        with (
            served.client() as client,
            connect_sse(
                client, "POST", "/v1/images/generations", json=body, headers=headers
            ) as source,
        ):
            for sse in source.iter_sse():
                if sse.json()["step"] == 3:
                    break
        until(lambda: at_rest(served))
        (stopped,) = [e for e in observed.of(RequestCancelled) if e.request_id == "watcher-1"]
        assert stopped.stage == "denoise"
        assert stopped.step < 1000

    def test_error_after_the_stream_began_is_an_error_event(self, shared_t2i: SharedT2i) -> None:
        """A refusal met once the stream began arrives as an error event with the refusal."""
        served = shared_t2i()
        with served.client() as client:
            response, events = stream(client, attention_backend="flash_attn_9")
        assert response.status_code == 200
        ((kind, data),) = events
        assert kind == "error"
        assert data["error"]["code"] == "attention.invalid_override"


class TestPreviewSteps:
    def test_previews_spread_over_the_steps(self) -> None:
        """At most partial_images previews, spread evenly, never before step 1."""
        assert preview_steps(4, 3) == {1, 2, 3}
        assert preview_steps(10, 3) == {2, 5, 7}
        assert preview_steps(2, 3) == {1}
        assert preview_steps(8, 0) == frozenset()
