"""The worker over loopback HTTP: override rules, the queue, load, the official openai client."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import msgspec
import pytest
import torch

from components.batch import Batch
from lifecycle.logs import configure_logging, saved_logging
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.bodies import EmbeddingsBody, ImagesBody
from lifecycle.serving.jobs import OUTPUT_TOLERANCE, BatchKey, Job
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec
from tests.conftest import decode_png
from tests.lifecycle.serving.conftest import (
    WATCHDOG_S,
    Gate,
    Served,
    Servers,
    ServeSpec,
    SharedT2i,
    openai_client,
    run_alone,
)
from tests.lifecycle.test_override import CALLS, counting  # noqa: F401  (a fixture)

pytestmark = pytest.mark.long

SpecMaker = Callable[..., PipelineSpec]
SENTENCES = ["A red fox leaps over a snowy fence.", "Ramen with a soft-boiled egg.", "Hi"]


def generate(client: httpx.Client, **body: Any) -> httpx.Response:
    """POST an image generation request."""
    return client.post("/v1/images/generations", json={"prompt": "a red fox", **body})


class TestOverrideOverHttp:
    @pytest.mark.parametrize(
        ("backend", "code", "words"),
        [
            ("flash_attn_9", "attention.invalid_override", "is not a known backend"),
            ("sliding_window", "attention.invalid_override", "is sparse"),
            ("torch_sdpa", "attention.capability_missing", "packed varlen"),
            ("flash_attn", "attention.unavailable_backend", "flash_attn"),
        ],
    )
    def test_refused_override_is_400_with_the_refusal(
        self, shared_t2i: SharedT2i, backend: str, code: str, words: str
    ) -> None:
        """Each broken override rule is a 400 carrying the refusal; nothing runs."""
        served = shared_t2i()
        with served.client() as client:
            response = generate(client, attention_backend=backend, steps=1)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == code
        assert error["param"] == "attention_backend"
        assert words in error["refusals"][0]["message"]
        assert response.headers["x-request-id"].startswith("req-")

    def test_no_switchable_site_is_400(self, serve_spec: ServeSpec, t2i_spec: SpecMaker) -> None:
        """With the denoiser's backend explicit in the spec, any override is a 400."""
        spec = t2i_spec()
        components = dict(spec.components)
        components["transformer"] = components["transformer"].__class__(
            kind="tiny_dit", attention_backend="torch_flash"
        )
        served = serve_spec(spec.__class__(**{**_fields(spec), "components": components}))
        with served.client() as client:
            response = generate(client, attention_backend="reference", steps=1)
        assert response.status_code == 400
        assert "no switchable attention site" in response.json()["error"]["message"]

    def test_accepted_override_equals_the_embedded_api(self, shared_t2i: SharedT2i) -> None:
        """An accepted override answers 200 with the image the Python API makes for it."""
        served = shared_t2i()
        with served.client() as client:
            response = generate(client, attention_backend="reference", steps=2, seed=7)
        assert response.status_code == 200
        image = decode_png(_b64(response.json()["data"][0]["b64_json"]))
        key = BatchKey(
            endpoint="images", steps=2, attention_backend="reference", latent_size=(4, 4)
        )
        job = Job(id="x", key=key, prompts=["a red fox"], tokens=16, seed=7)
        expected = _pixels(run_alone(served.worker, job)[0])
        assert (image.int() - expected.int()).abs().max() <= 1

    @pytest.mark.usefixtures("counting")
    def test_concurrent_overrides_run_their_own_kernels(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """Concurrent requests naming two backends: each kernel runs exactly its requests'
        calls, and no batch mixes the two."""
        served = serve_spec(t2i_spec(batch_window_ms=50))
        backends = ["counting_a", "counting_b"] * 4

        def send(backend: str) -> httpx.Response:
            with served.client() as client:
                return generate(client, attention_backend=backend, steps=2, seed=1)

        with ThreadPoolExecutor(len(backends)) as pool:
            responses = list(pool.map(send, backends))
        assert [r.status_code for r in responses] == [200] * len(backends)
        batches: dict[str, set[str]] = {}
        for backend, response in zip(backends, responses, strict=True):
            batches.setdefault(response.headers["x-batch-id"], set()).add(backend)
        assert all(len(found) == 1 for found in batches.values())
        calls: dict[str, int] = {}
        for (backend, _), count in CALLS.items():
            calls[backend] = calls.get(backend, 0) + count
        layers = 2  # tiny_dit's default blocks, one packed self-attention call each a step
        per_backend = {b: {k for k, v in batches.items() if b in v} for b in set(backends)}
        assert calls == {b: 2 * layers * len(per_backend[b]) for b in per_backend}


class TestQueue:
    def test_full_queue_is_429(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker, gated: Gate
    ) -> None:
        """With serving.max_queue jobs in flight, the next request is answered 429."""
        served = serve_spec(t2i_spec(max_queue=1))
        batcher = served.worker.batcher
        assert batcher is not None
        with served.client() as client, ThreadPoolExecutor(1) as pool:
            held = pool.submit(generate, client, attention_backend="gated", steps=1)
            assert gated.reached.wait(WATCHDOG_S)
            assert batcher.in_flight == 1
            response = generate(client, steps=1)
            gated.opened.set()
            assert held.result(timeout=WATCHDOG_S).status_code == 200
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "queue_full"
        assert response.headers["retry-after"] == "1"


class TestBadInput:
    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({"size": "15x16"}, "size"),
            ({"size": "big"}, "size"),
            ({"response_format": "url"}, "response_format"),
            ({"n": 0}, "n"),
            ({"guidance_scale": -1}, "guidance_scale"),
            ({"colour": "red"}, "colour"),
        ],
    )
    def test_bad_image_request_is_400_naming_the_field(
        self, shared_t2i: SharedT2i, body: dict[str, Any], param: str
    ) -> None:
        """A bad field is a 400 OpenAI error object that names it."""
        served = shared_t2i()
        with served.client() as client:
            response = generate(client, **body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param

    def test_guidance_scale_reaches_the_denoiser(self, shared_t2i: SharedT2i) -> None:
        """Guidance and a negative prompt each change the image a request gets."""
        served = shared_t2i()
        with served.client() as client:
            responses = [
                generate(client, seed=3),
                generate(client, seed=3, guidance_scale=4.0),
                generate(client, seed=3, guidance_scale=4.0, negative_prompt="blurry, dark"),
            ]
        assert [response.status_code for response in responses] == [200, 200, 200]
        pngs = [response.json()["data"][0]["b64_json"] for response in responses]
        assert len(set(pngs)) == 3

    def test_endpoint_the_pipeline_does_not_serve_is_404(self, shared_t2i: SharedT2i) -> None:
        """A text-to-image pipeline answers /v1/embeddings with 404 naming an example."""
        served = shared_t2i()
        with served.client() as client:
            response = client.post("/v1/embeddings", json={"input": "a red fox"})
        assert response.status_code == 404
        assert "examples/minilm_embed.toml" in response.json()["error"]["message"]


LONG = "b" * 100_000
"""A name of 100,000 characters (an attention_backend so made a 200 KB answer and a 100 KB
log line)."""
ECHO_BOUND = 1_000
"""The most bytes an answer or a log line about a bad value may take, whatever its length."""


def logged_request(
    served: Served, method: str, path: str, body: dict[str, Any] | None
) -> tuple[httpx.Response, list[str]]:
    """Send one request; return its answer and the JSON log lines written meanwhile."""
    stream = io.StringIO()
    with saved_logging(), served.client() as client:
        configure_logging("json", "debug", stream)
        response = client.request(method, path, json=body)
    return response, stream.getvalue().splitlines()


class TestEchoes:
    @pytest.mark.parametrize(
        ("method", "path", "body", "status"),
        [
            ("POST", "/v1/images/generations", {"attention_backend": LONG}, 400),
            ("POST", "/v1/images/generations", {"model": LONG}, 404),
            ("POST", "/v1/images/generations", {"lora": {LONG: 1.0}}, 400),
            ("POST", "/v1/images/generations", {LONG: 1}, 400),  # an unknown field
            ("POST", "/v1/images/generations", {"response_format": LONG}, 400),
            ("POST", "/v1/images/generations", {"size": LONG}, 400),
            ("GET", "/v1/requests/" + LONG[:20_000], None, 404),  # a URL within the header bound
            ("DELETE", "/v1/requests/" + LONG[:20_000], None, 404),
        ],
        ids=[
            "attention_backend",
            "model",
            "lora",
            "unknown field",
            "enum value",
            "size",
            "status",
            "cancel",
        ],
    )
    def test_an_overlong_value_is_cut_in_the_answer_and_the_log(
        self,
        shared_t2i: SharedT2i,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        status: int,
    ) -> None:
        """A 100,000-character value is repeated as its first characters and '...': the
        answer and any log line stay under 1 KB."""
        json = None if body is None else {"prompt": "a red fox", "steps": 1, **body}
        response, lines = logged_request(shared_t2i(), method, path, json)
        assert response.status_code == status
        assert len(response.content) < ECHO_BOUND
        message = response.json()["error"]["message"]
        assert repr(LONG[:10])[:-1] in message  # its start, quoted
        assert "..." in message
        assert all(len(line) < ECHO_BOUND for line in lines)

    def test_an_overlong_backend_is_cut_in_the_refusal_logged(self, shared_t2i: SharedT2i) -> None:
        """The refusal of a 100,000-character attention_backend is logged in a line under
        1 KB (it was 100 KB) and answered in under 1 KB (200 KB: the message and the
        refusal each held the name)."""
        body = {"prompt": "a red fox", "steps": 1, "attention_backend": LONG}
        response, lines = logged_request(shared_t2i(), "POST", "/v1/images/generations", body)
        (refused,) = [line for line in lines if '"lifecycle.refused"' in line]
        assert "attention_backend 'bbbb" in refused
        assert len(refused) < ECHO_BOUND
        error = response.json()["error"]
        assert error["code"] == "attention.invalid_override"
        assert len(response.content) < ECHO_BOUND

    def test_an_overlong_model_of_embeddings_is_cut(self, minilm: Served) -> None:
        """An embeddings request naming a 100,000-character model is a short 404."""
        with minilm.client() as client:
            response = client.post("/v1/embeddings", json={"input": "a", "model": LONG})
        assert response.status_code == 404
        assert len(response.content) < ECHO_BOUND


@pytest.fixture(scope="module")
def minilm(module_servers: Servers, root: Path) -> Served:
    """The module's worker of examples/minilm_embed.toml."""
    pytest.importorskip("tokenizers")
    return module_servers([load_spec(root / "examples" / "minilm_embed.toml")])


class TestEmbeddingsBody:
    def test_bodies_decode_to_openai_answers_or_name_the_bad_field(self, minilm: Served) -> None:
        """A bad embeddings body is a 400 naming its field; float and base64 answers agree."""
        served = minilm
        with served.client() as client:
            empty = client.post("/v1/embeddings", json={"input": []})
            extra = client.post("/v1/embeddings", json={"input": "a", "dimensions": 3})
            floats = client.post("/v1/embeddings", json={"input": ["a red fox", "ramen"]})
            packed = client.post(
                "/v1/embeddings",
                json={"input": ["a red fox", "ramen"], "encoding_format": "base64"},
            )
        assert [empty.status_code, extra.status_code] == [400, 400]
        assert empty.json()["error"]["param"] == "input"
        assert "Expected `array` of length >= 1 - at `$.input`" in empty.json()["error"]["message"]
        assert extra.json()["error"] == {
            "message": "bad request body: Object contains unknown field `dimensions`",
            "type": "invalid_request_error",
            "param": "dimensions",
            "code": "invalid_body",
        }
        assert empty.headers["x-request-id"].startswith("req-")
        answer = floats.json()
        assert [item["index"] for item in answer["data"]] == [0, 1]
        assert answer["model"] == "minilm-embed"
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 2
        for item, encoded in zip(answer["data"], packed.json()["data"], strict=True):
            vector = struct.unpack(f"<{len(item['embedding'])}f", _b64(encoded["embedding"]))
            assert list(vector) == pytest.approx(item["embedding"], abs=1e-6)


class TestLoad:
    def test_concurrent_clients_under_an_evicting_budget(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """32 clients, 200 requests, a budget that forces eviction: no errors, results as
        run alone, resident bytes within the budget at every move."""
        budget = 260_000  # the VAE (248,588 B) alone; every stage evicts the others
        served = serve_spec(
            t2i_spec(
                memory={"device_budget": budget},
                batch_window_ms=20,
                max_batch=8,
                max_queue=64,
            )
        )
        prompts = ["a red fox", "ramen at night", "a lighthouse in a storm", "a cat"]

        def body(i: int) -> dict[str, Any]:
            return {"prompt": prompts[i % 4], "seed": i, "steps": 1 + i % 2}

        def client_run(first: int) -> list[tuple[int, httpx.Response]]:
            with served.client() as client:
                return [
                    (i, generate(client, **body(i)))
                    for i in range(first, 200, 32)  # client k sends requests k, k+32, ...
                ]

        with ThreadPoolExecutor(32) as pool:
            results = [r for rs in pool.map(client_run, range(32)) for r in rs]
        assert len(results) == 200
        assert [r.status_code for _, r in results] == [200] * 200
        assert max(served.resident_at_moves) <= budget
        evictions = [m for m in served.moves if m.direction == "offload"]
        assert len(evictions) > 10
        for i, response in results[::10]:  # every tenth against a sequential run
            got = decode_png(_b64(response.json()["data"][0]["b64_json"]))
            key = BatchKey(endpoint="images", steps=1 + i % 2, latent_size=(4, 4))
            job = Job(id=str(i), key=key, prompts=[prompts[i % 4]], tokens=16, seed=i)
            assert (got.int() - _pixels(run_alone(served.worker, job)[0]).int()).abs().max() <= 1
        metrics = served.get("/metrics").text
        assert "lifecycle_refusals_total{" not in metrics  # no request was refused
        assert "lifecycle_batch_size_count" in metrics
        assert OUTPUT_TOLERANCE < 1 / 255  # a pixel level: batched images round alike or by 1


class TestOpenApi:
    def test_bodies_the_routes_decode_are_documented_by_their_types(
        self, shared_t2i: SharedT2i, minilm: Served
    ) -> None:
        """/openapi.json of two apps of this process documents the bodies the routes decode
        themselves alike: a required JSON body with its type's fields and required ones."""
        documents = []
        for served in (shared_t2i(), minilm):
            with served.client() as client:
                documents.append(client.get("/openapi.json").json()["paths"])
        for route, body_type in (
            ("/v1/images/generations", ImagesBody),
            ("/v1/embeddings", EmbeddingsBody),
        ):
            bodies = [paths[route]["post"]["requestBody"] for paths in documents]
            schema = bodies[0]["content"]["application/json"]["schema"]
            assert bodies[1] == bodies[0]
            assert bodies[0]["required"] is True
            fields = msgspec.structs.fields(body_type)
            assert tuple(schema["properties"]) == tuple(field.name for field in fields)
            assert schema["required"] == [f.name for f in fields if f.required]


class TestOpenAiClient:
    """The official openai client against the worker's OpenAI-compatible endpoints."""

    def test_embeddings_equal_the_embedded_api(self, minilm: Served, openai: ModuleType) -> None:
        """client.embeddings.create returns the vectors the Python API computes."""
        spec = minilm.worker.orchestrator.spec
        with Orchestrator(spec) as orch:
            orch.load()
            batch = Batch(generator=torch.Generator(), prompts=SENTENCES, size=len(SENTENCES))
            with orch.request() as request:
                request.run("encode", batch)
            assert batch.sentence_embeddings is not None
            expected = batch.sentence_embeddings
        client = openai_client(openai, minilm.url, "unused")
        response = client.embeddings.create(model="minilm-embed", input=SENTENCES)
        floats = client.embeddings.create(
            model="minilm-embed", input=SENTENCES[0], encoding_format="float"
        )
        got = torch.tensor([item.embedding for item in response.data])
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-5)
        assert torch.allclose(torch.tensor(floats.data[0].embedding), expected[0], atol=1e-5)
        assert response.usage.prompt_tokens > len(SENTENCES)

    def test_images_generate_returns_a_png_of_the_size(
        self, shared_t2i: SharedT2i, openai: ModuleType
    ) -> None:
        """client.images.generate returns n PNGs of the declared size."""
        served = shared_t2i()  # examples/tiny_t2i.toml: model tiny-t2i
        client = openai_client(openai, served.url, "unused")
        response = client.images.generate(
            model="tiny-t2i",
            prompt="a lighthouse in a storm",
            n=2,
            size="32x16",  # type: ignore[arg-type]  # this pipeline's sizes are small
            response_format="b64_json",
            extra_body={"seed": 3, "steps": 2},
        )
        assert response.data is not None
        images = [decode_png(_b64(d.b64_json or "")) for d in response.data]
        assert [tuple(image.shape) for image in images] == [(16, 32, 3)] * 2


def _b64(text: str) -> bytes:
    import base64

    return base64.b64decode(text)


def _pixels(image: Any) -> Any:
    """Return ``image`` ``(3, H, W)`` in [-1, 1] as the worker's PNG pixels ``(H, W, 3)``."""
    return ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0)


def _fields(spec: PipelineSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__struct_fields__}
