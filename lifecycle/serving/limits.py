"""What one request may ask: its body's type and size, and the ``[serving]`` bounds.

Every check runs before any work is queued, so no request, however large, costs the
worker more than reading up to ``serving.max_body_bytes`` and decoding them. The body
is bounded as it arrives (``BodyLimits``, pure ASGI: a declared length over the limit
is refused before a byte is read, and a chunked body is counted chunk by chunk); the
decoded request is bounded by the functions below, each excess a 400 naming its key.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.serving.bodies import EmbeddingsBody, ImagesBody, VideosBody
from lifecycle.serving.errors import ApiError, error_response
from lifecycle.shown import shown
from lifecycle.spec.structs import ServingConfig

__all__ = [
    "JSON_TYPE",
    "BodyLimits",
    "ImageSize",
    "check_embeddings",
    "check_images",
    "check_videos",
    "image_pixels",
    "video_pixels",
]

JSON_TYPE = "application/json"
FORM_TYPE = b"multipart/form-data"
FORM_PATHS = frozenset({"/v1/videos"})
"""The routes that read a multipart form too: the openai client sends ``videos.create`` so."""
_SIZE = re.compile(r"([0-9]{1,12})x([0-9]{1,12})")
"""``WIDTHxHEIGHT`` in ASCII digits; longer numbers are no size (and never reach ``int``)."""


class BodyLimits:
    """Refuse a body that is not JSON or is encoded (415), or is larger than ``limit``
    bytes (413).

    ``FORM_PATHS`` take a multipart form as well, from a client that sends no ``Origin``:
    a browser sends one with every cross-origin POST, and a form is a request it sends
    without a CORS preflight, so no web page starts work that way.

    A request without a body passes untouched. The 413 closes the connection, so the
    rest of an oversized body is never read.

    Args:
        app: the application it wraps.
        limit: ``serving.max_body_bytes``.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the declared type and length, then count the body as the app reads it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        chunked = b"transfer-encoding" in headers
        if not chunked and declared in (None, b"0"):
            await self.app(scope, receive, send)
            return
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        refused = None
        if media_type != JSON_TYPE.encode() and not _form_taken(scope, media_type, headers):
            refused = unsupported_media_type(media_type.decode("latin-1"))
        elif encoding != b"identity":
            refused = unsupported_encoding(encoding.decode("latin-1"))
        elif declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            refused = body_too_large(self.limit)
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            return
        await self.app(scope, _Counted(receive, self.limit), send)


def _form_taken(scope: Scope, media_type: bytes, headers: dict[bytes, bytes]) -> bool:
    """Tell whether the request is a multipart form that its route reads (``FORM_PATHS``),
    sent by no browser (no ``Origin``)."""
    return (
        media_type == FORM_TYPE
        and scope["method"] == "POST"
        and scope["path"] in FORM_PATHS
        and b"origin" not in headers
    )


class _Counted:
    """A ``receive`` that raises a 413 once the body read so far passes ``limit`` bytes."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive = receive
        self.limit = limit
        self.read = 0

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.limit:
                raise body_too_large(self.limit)  # answered by the ApiError handler
        return message


def unsupported_media_type(found: str) -> ApiError:
    """Return the 415 of a body that is not JSON (a browser sends text/plain without asking)."""
    return ApiError(
        415,
        f"the body must be JSON: send content-type: {JSON_TYPE}, not "
        f"{shown(found) if found else 'none'}",
        code="unsupported_media_type",
    )


def unsupported_encoding(found: str) -> ApiError:
    """Return the 415 of a body sent compressed (RFC 9110: the content coding is not
    accepted), with the coding the worker reads (RFC 7694's ``accept-encoding``)."""
    return ApiError(
        415,
        f"the body must not be encoded: the worker reads no content-encoding, got "
        f"{shown(found)}; send the JSON uncompressed, without that header",
        code="unsupported_content_encoding",
        headers={"accept-encoding": "identity"},
    )


def body_too_large(limit: int) -> ApiError:
    """Return the 413 of a body over ``serving.max_body_bytes``; it closes the connection."""
    return ApiError(
        413,
        f"the body is larger than serving.max_body_bytes = {limit} bytes; send less per "
        "request, or raise serving.max_body_bytes in the spec",
        code="body_too_large",
        headers={"connection": "close"},
    )


def check_embeddings(body: EmbeddingsBody, settings: ServingConfig) -> list[str]:
    """Return the body's inputs, once they are within ``serving.max_inputs`` and
    ``serving.max_input_chars``.

    Raises:
        ApiError: 400 naming the limit exceeded and its key.
    """
    inputs = [body.input] if isinstance(body.input, str) else body.input
    _at_most(len(inputs), settings.max_inputs, "max_inputs", "input", "inputs per request")
    for index, text in enumerate(inputs):
        what = f"characters in input[{index}]"
        _at_most(len(text), settings.max_input_chars, "max_input_chars", "input", what)
    return inputs


class ImageSize(NamedTuple):
    """The pixels asked for each image, (height, width) as torch and the recipes order them;
    a request writes ``WIDTHxHEIGHT``."""

    height: int
    width: int


def check_images(body: ImagesBody, settings: ServingConfig) -> ImageSize | None:
    """Return ``size`` parsed once, into (height, width) (None when not given), once the
    body is within bounds.

    Checks ``serving.max_n``, ``max_steps``, ``max_prompt_chars``, ``max_image_side``
    and, for a given size, ``max_pixels``; ``image_pixels`` checks the pixels of the
    pipeline's default size once the worker knows it.

    Raises:
        ApiError: 400 naming the limit exceeded and its key, or a size that is not
            ``WIDTHxHEIGHT``.
    """
    _at_most(body.n, settings.max_n, "max_n", "n", "images per request (n)")
    _steps_and_prompts(body, settings)
    if body.size is None:
        return None
    size = parse_size(body.size, settings)
    image_pixels(body.n, size, settings)
    return size


def check_videos(body: VideosBody, settings: ServingConfig) -> ImageSize | None:
    """Return ``size`` parsed once (None when not given), once ``steps``, the prompts and
    the size's sides are within bounds; ``video_pixels`` checks the frames and pixels.

    Raises:
        ApiError: 400 naming the limit exceeded and its key, or a bad size.
    """
    _steps_and_prompts(body, settings)
    return None if body.size is None else parse_size(body.size, settings)


def video_pixels(frames: int, size: ImageSize, settings: ServingConfig) -> None:
    """Refuse a video of ``frames`` frames of ``size`` over ``serving.max_frames`` or
    ``serving.max_video_pixels``.

    Raises:
        ApiError: 400 naming the key.
    """
    _at_most(frames, settings.max_frames, "max_frames", "num_frames", "frames in a video")
    pixels = frames * size.width * size.height
    what = f"pixels in {frames} frames of {size.width}x{size.height}"
    _at_most(pixels, settings.max_video_pixels, "max_video_pixels", "size", what)


def _steps_and_prompts(body: ImagesBody | VideosBody, settings: ServingConfig) -> None:
    """Check ``serving.max_steps`` and ``max_prompt_chars`` (the negative prompt too)."""
    if body.steps is not None:  # None takes the pipeline's default
        _at_most(body.steps, settings.max_steps, "max_steps", "steps", "denoising steps")
    _at_most(len(body.prompt), settings.max_prompt_chars, "max_prompt_chars", "prompt", "prompt")
    if body.negative_prompt is not None:
        _at_most(
            len(body.negative_prompt),
            settings.max_prompt_chars,
            "max_prompt_chars",
            "negative_prompt",
            "negative prompt",
        )


def parse_size(text: str, settings: ServingConfig) -> ImageSize:
    """Return ``WIDTHxHEIGHT`` as (height, width), each side within ``serving.max_image_side``.

    Raises:
        ApiError: 400: not ``WIDTHxHEIGHT``, a side of 0, or a side over the bound.
    """
    found = _SIZE.fullmatch(text)
    if found is None:
        raise ApiError(
            400,
            f"size {shown(text)} is not WIDTHxHEIGHT in pixels, e.g. '512x512'",
            param="size",
            code="invalid_size",
        )
    size = ImageSize(height=int(found.group(2)), width=int(found.group(1)))
    if not size.width or not size.height:
        raise ApiError(
            400,
            f"size {shown(text)} has a side of 0 pixels; ask for at least 1 pixel a side, "
            "e.g. '512x512'",
            param="size",
            code="invalid_size",
        )
    side = settings.max_image_side
    _at_most(size.width, side, "max_image_side", "size", "pixels of width")
    _at_most(size.height, side, "max_image_side", "size", "pixels of height")
    return size


def image_pixels(n: int, size: ImageSize, settings: ServingConfig) -> None:
    """Refuse ``n`` images of ``size`` over ``serving.max_pixels`` together.

    Raises:
        ApiError: 400 naming ``serving.max_pixels``.
    """
    pixels = n * size.width * size.height
    what = f"pixels in {n} image{'s' if n != 1 else ''} of {size.width}x{size.height}"
    _at_most(pixels, settings.max_pixels, "max_pixels", "size", what)


def _at_most(value: int, limit: int, key: str, param: str, what: str) -> None:
    if value <= limit:
        return
    raise ApiError(
        400,
        f"{value} {what} is over serving.{key} = {limit}; ask for at most {limit}, or "
        f"raise serving.{key} in the spec",
        param=param,
        code="limit_exceeded",
        extra={"limit": f"serving.{key}"},
    )
