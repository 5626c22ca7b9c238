"""Bounded requests: every [serving] limit at its value and one over, checked before work."""

from __future__ import annotations

import gzip
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch
from safetensors.torch import save_file

from components import registry
from components.batch import Batch
from lifecycle.serving.bodies import ImagesBody
from lifecycle.serving.jobs import BatchKey, Job, split_outputs
from lifecycle.serving.limits import check_images
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec, ServingConfig
from tests.lifecycle.serving.conftest import WATCHDOG_S, Served, ServeSpec, SharedT2i
from tests.lifecycle.serving.test_metrics import counted

SpecMaker = Callable[..., PipelineSpec]
IMAGE_LIMITS = {
    "max_n": 2,
    "max_steps": 3,
    "max_prompt_chars": 20,
    "max_image_side": 64,
    "max_pixels": 1024,
    "max_body_bytes": 300,
}
"""Small limits for the reference pipeline (4 image pixels per latent position a side):
a 32x32 image is exactly max_pixels, a 64x16 one exactly max_image_side wide."""
JSON = {"content-type": "application/json"}


def generate(client: httpx.Client, **body: Any) -> httpx.Response:
    """POST an image request of one step (the limits are what is tested)."""
    return client.post("/v1/images/generations", json={"prompt": "a red fox", "steps": 1, **body})


def refused_for(response: httpx.Response, key: str, param: str) -> bool:
    """Tell whether ``response`` is the 400 naming limit ``serving.key`` at ``param``."""
    error = response.json()["error"]
    return (
        response.status_code == 400
        and error["code"] == "limit_exceeded"
        and error["limit"] == f"serving.{key}"
        and error["param"] == param
        and f"serving.{key} = " in error["message"]
    )


def batches_run(served: Served) -> float:
    """Return how many batches the worker has started (its warm-up is not one)."""
    with served.client() as client:
        return counted(client.get("/metrics").text).get("lifecycle_batch_size_count", 0.0)


@pytest.fixture
def limited(shared_t2i: SharedT2i) -> Served:
    """The module's reference pipeline under ``IMAGE_LIMITS``."""
    return shared_t2i(**IMAGE_LIMITS)


@pytest.fixture
def plain(shared_t2i: SharedT2i) -> Served:
    """The module's reference pipeline with the default limits."""
    return shared_t2i()


class TestImageLimits:
    def test_a_size_is_read_once_into_height_and_width(self) -> None:
        """``WIDTHxHEIGHT`` comes back as (height, width), the order every later step uses."""
        size = check_images(ImagesBody(prompt="a fox", size="48x32"), ServingConfig())
        assert size is not None
        assert (size.height, size.width) == (32, 48)
        assert size == (32, 48)

    @pytest.mark.parametrize(
        ("key", "param", "at_limit", "over"),
        [
            ("max_n", "n", {"n": 2}, {"n": 3}),
            ("max_steps", "steps", {"steps": 3}, {"steps": 4}),
            ("max_prompt_chars", "prompt", {"prompt": "p" * 20}, {"prompt": "p" * 21}),
            (
                "max_prompt_chars",
                "negative_prompt",
                {"negative_prompt": "n" * 20},
                {"negative_prompt": "n" * 21},
            ),
            ("max_image_side", "size", {"size": "64x16"}, {"size": "65x16"}),
            ("max_image_side", "size", {"size": "16x64"}, {"size": "16x65"}),
            ("max_pixels", "size", {"size": "32x32"}, {"size": "41x25"}),  # 1024, 1025
            ("max_pixels", "size", {"n": 2, "size": "32x16"}, {"n": 2, "size": "32x17"}),
        ],
    )
    def test_a_limit_takes_its_value_and_refuses_one_more(
        self,
        limited: Served,
        key: str,
        param: str,
        at_limit: dict[str, Any],
        over: dict[str, Any],
    ) -> None:
        """At its value a request runs (200); one over is a 400 naming serving.KEY, and
        nothing was queued for it."""
        with limited.client() as client:
            accepted = generate(client, **at_limit)
            before = batches_run(limited)
            refused = generate(client, **over)
        assert accepted.status_code == 200, accepted.text
        assert refused_for(refused, key, param), refused.text
        assert batches_run(limited) == before

    def test_the_default_size_counts_against_max_pixels(self, shared_t2i: SharedT2i) -> None:
        """Without ``size``, n images of the pipeline's default 16x16 count too: 4 fit 1024
        pixels, a fifth does not (the 10^8-images request of the probe is refused so)."""
        served = shared_t2i(max_pixels=1024)
        with served.client() as client:
            fits = generate(client, n=4)
            over = generate(client, n=5)
            huge = generate(client, n=10**8)
        assert fits.status_code == 200
        assert refused_for(over, "max_pixels", "size")
        assert refused_for(huge, "max_n", "n")

    @pytest.mark.parametrize("size", ["²x²", "1" * 5000 + "x16", "16x16x16", "-16x16", "16X16"])
    def test_a_size_that_is_not_width_x_height_is_400(self, plain: Served, size: str) -> None:
        """Unicode digits, 5,000-digit widths and other shapes are a 400 naming size."""
        with plain.client() as client:
            response = generate(client, size=size)
        error = response.json()["error"]
        assert response.status_code == 400
        assert error["code"] == "invalid_size"
        assert error["param"] == "size"
        assert len(error["message"]) < 200  # a huge size is not echoed whole

    @pytest.mark.parametrize(
        ("size", "words"),
        [
            ("0x0", "has a side of 0 pixels"),
            ("0x16", "has a side of 0 pixels"),
            ("15x15", "must be positive multiples of 4 pixels"),
            ("16x18", "must be positive multiples of 4 pixels"),
        ],
    )
    def test_a_size_the_pipeline_cannot_make_is_invalid_size(
        self, plain: Served, size: str, words: str
    ) -> None:
        """A side of 0 or off the pipeline's grid is a 400 invalid_size naming size, as every
        other size error is (its code was null)."""
        with plain.client() as client:
            response = generate(client, size=size)
        error = response.json()["error"]
        assert response.status_code == 400
        assert (error["code"], error["param"]) == ("invalid_size", "size")
        assert words in error["message"]

    @pytest.mark.parametrize("scale", ["100.0", "100.5", "1e30", "1e999"])
    def test_guidance_scale_is_bounded(self, plain: Served, scale: str) -> None:
        """guidance_scale up to 100 runs; beyond it (1e30 made an all-black NaN image) and
        1e999 (infinity, as JSON parsers read it) are 400."""
        with plain.client() as client:
            response = client.post(
                "/v1/images/generations",
                content=f'{{"prompt": "a red fox", "steps": 1, "guidance_scale": {scale}}}',
                headers={"content-type": "application/json"},
            )
        if float(scale) <= 100:
            assert response.status_code == 200
        else:
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "guidance_scale"


class TestEmbeddingLimits:
    @pytest.fixture
    def minilm(self, serve_spec: ServeSpec, root: Path) -> Served:
        """Serve MiniLM embeddings with 3 inputs of at most 40 characters a request."""
        pytest.importorskip("tokenizers")
        spec = load_spec(root / "examples" / "minilm_embed.toml")
        limits = {"max_inputs": 3, "max_input_chars": 40}
        return serve_spec(
            msgspec.structs.replace(spec, serving=msgspec.convert(limits, type(spec.serving)))
        )

    def test_inputs_and_characters_take_their_value_and_refuse_one_more(
        self, minilm: Served
    ) -> None:
        """3 inputs of 40 characters run; a fourth input, or a 41st character in any
        input, is a 400 naming the key, with nothing queued."""
        with minilm.client() as client:
            accepted = client.post("/v1/embeddings", json={"input": ["x" * 40] * 3})
            before = batches_run(minilm)
            inputs = client.post("/v1/embeddings", json={"input": ["x"] * 4})
            chars = client.post("/v1/embeddings", json={"input": ["x", "y" * 41]})
            single = client.post("/v1/embeddings", json={"input": "z" * 41})
        assert accepted.status_code == 200
        assert refused_for(inputs, "max_inputs", "input")
        assert refused_for(chars, "max_input_chars", "input")
        assert "41 characters in input[1]" in chars.json()["error"]["message"]
        assert refused_for(single, "max_input_chars", "input")
        assert batches_run(minilm) == before

    def test_truncated_inputs_are_listed(self, serve_spec: ServeSpec, root: Path) -> None:
        """An input past MiniLM's 256 word pieces is cut, and the answer lists its index."""
        pytest.importorskip("tokenizers")
        served = serve_spec(load_spec(root / "examples" / "minilm_embed.toml"))
        long = "the quick brown fox jumps over the lazy dog " * 60  # 540 words
        with served.client() as client:
            answer = client.post("/v1/embeddings", json={"input": ["short", long]}).json()
        assert answer["truncated_inputs"] == [1]
        assert answer["usage"]["prompt_tokens"] == 3 + 256


class TestBody:
    def test_body_bytes_take_their_value_and_refuse_one_more(self, limited: Served) -> None:
        """A body of exactly serving.max_body_bytes runs; one byte more is a 413 that
        closes the connection."""
        body = msgspec.json.encode({"prompt": "a red fox", "steps": 1})
        exact = body + b" " * (IMAGE_LIMITS["max_body_bytes"] - len(body))
        with limited.client() as client:
            accepted = client.post("/v1/images/generations", content=exact, headers=JSON)
            refused = client.post("/v1/images/generations", content=exact + b" ", headers=JSON)
        assert accepted.status_code == 200
        assert refused.status_code == 413
        assert refused.headers["connection"] == "close"
        error = refused.json()["error"]
        assert error["code"] == "body_too_large"
        assert "serving.max_body_bytes = 300 bytes" in error["message"]

    def test_a_chunked_body_is_counted_as_it_arrives(self, limited: Served) -> None:
        """A body without a length, sent in chunks, is refused once past the limit (413)."""

        def chunks() -> Iterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"x" * 100
            yield b'"}'

        with limited.client() as client:
            response = client.post("/v1/images/generations", content=chunks(), headers=JSON)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "body_too_large"

    def test_a_declared_length_over_the_limit_is_refused_before_the_body(
        self, limited: Served
    ) -> None:
        """A 50 MB content-length is answered 413 at once, the body never sent."""
        host, port = limited.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=WATCHDOG_S) as sock:
            sock.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: 52428800\r\n\r\n"
            )
            answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"body_too_large" in answer

    @pytest.mark.parametrize(
        "content_type", ["text/plain", "application/x-www-form-urlencoded", None]
    )
    def test_only_json_bodies_are_taken(self, limited: Served, content_type: str | None) -> None:
        """A body sent as text/plain, a form or with no type is a 415; JSON with a charset runs."""
        body = msgspec.json.encode({"prompt": "a red fox", "steps": 1})
        headers = {} if content_type is None else {"content-type": content_type}
        with limited.client() as client:
            refused = client.post("/v1/images/generations", content=body, headers=headers)
            accepted = client.post(
                "/v1/images/generations",
                content=body,
                headers={"content-type": "Application/JSON; charset=utf-8"},
            )
        assert refused.status_code == 415
        assert refused.json()["error"]["code"] == "unsupported_media_type"
        assert accepted.status_code == 200

    @pytest.mark.parametrize("encoding", ["gzip", "deflate, gzip", "br"])
    def test_an_encoded_body_is_415(self, limited: Served, encoding: str) -> None:
        """A body with a content-encoding is a 415 naming it, with accept-encoding: identity
        (gzip was read as JSON: 400 "JSON is malformed"); content-encoding: identity runs."""
        body = msgspec.json.encode({"prompt": "a red fox", "steps": 1})
        packed = gzip.compress(body) if encoding == "gzip" else body
        with limited.client() as client:
            refused = client.post(
                "/v1/images/generations",
                content=packed,
                headers={**JSON, "content-encoding": encoding},
            )
            accepted = client.post(
                "/v1/images/generations",
                content=body,
                headers={**JSON, "content-encoding": "Identity"},
            )
        error = refused.json()["error"]
        assert refused.status_code == 415
        assert error["code"] == "unsupported_content_encoding"
        assert repr(encoding) in error["message"]
        assert refused.headers["accept-encoding"] == "identity"
        assert accepted.status_code == 200


class TestNonFiniteOutput:
    def test_an_image_from_non_finite_latents_is_never_returned(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker, tmp_path: Path
    ) -> None:
        """A denoiser whose weights overflow float32 makes infinite latents: the request
        gets a 500 saying so, not a PNG; the split marks the job."""
        loader = registry.get("tiny_dit").from_options({})
        module = loader.build("custom")
        weights = tmp_path / "overflowing_dit.safetensors"
        save_file({n: t * 1e30 for n, t in module.state_dict().items()}, str(weights))
        spec = t2i_spec()
        components = dict(spec.components)
        options = {**components["transformer"].options, "weights": str(weights)}
        components["transformer"] = msgspec.structs.replace(
            components["transformer"], options=options
        )
        served = serve_spec(msgspec.structs.replace(spec, components=components))
        with served.client() as client:
            response = generate(client)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "non_finite_output"
        assert "b64_json" not in response.text


def _read_until_closed(sock: socket.socket) -> bytes:
    """Read what the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_job_holding_infinity_is_marked() -> None:
    """split_outputs marks a job whose latents hold infinity, even when its pixels are finite."""
    key = BatchKey(endpoint="images", latent_size=(1, 1))
    jobs = [Job(id=f"j{i}", key=key, prompts=["p"], tokens=1) for i in range(2)]
    batch = Batch(generator=torch.Generator(), size=2)
    batch.images = torch.zeros(2, 3, 4, 4)
    batch.latents = [torch.zeros(1, 4), torch.full((1, 4), float("inf"))]
    split_outputs(jobs, batch)
    assert [job.non_finite for job in jobs] == [False, True]
