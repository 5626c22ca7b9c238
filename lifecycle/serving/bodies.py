"""The request bodies the worker decodes (msgspec Structs), and how a bad one is answered."""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from lifecycle.serving.errors import ApiError
from lifecycle.shown import SHOWN_CHARS, shown
from lifecycle.spec.checks import NAME_PATTERN

__all__ = [
    "IMAGES_BODY",
    "VIDEOS_BODY",
    "AdapterBody",
    "EmbeddingsBody",
    "ImagesBody",
    "PipelineBody",
    "VideosBody",
    "convert_form",
    "decode_body",
    "documented",
]

MAX_GUIDANCE_SCALE = 100.0
"""The largest ``guidance_scale`` taken: pipelines use 1 to 20, and far beyond that the
guided prediction overflows float32 into an image of NaN."""

Priority = Annotated[int, Meta(ge=0)]
"""A request's ``priority``: higher first; at most ``serving.max_priority`` (checked
against the spec once decoded)."""

WorkerPath = Annotated[str, Meta(min_length=1, max_length=4096)]
"""A file on the worker's disk: no longer than Linux's PATH_MAX, so a path no file
system could name is a 400 before anything looks it up."""

Timeout = Annotated[float, Meta(gt=0)]
"""A request's ``timeout`` in seconds, queued and running; at most, and by default,
``serving.max_request_seconds``."""


class EmbeddingsBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/embeddings`` (OpenAI's fields this worker honours, and its own
    ``priority`` and ``timeout``)."""

    input: str | Annotated[list[str], Meta(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    priority: Priority = 0
    timeout: Timeout | None = None


class ImagesBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/images/generations``, with this worker's extra fields.

    ``steps`` and ``guidance_scale`` left out take the pipeline's defaults (a folder's
    pipeline class's, as diffusers' call has them).
    """

    prompt: str
    model: str | None = None
    n: Annotated[int, Meta(ge=1)] = 1
    size: str | None = None
    response_format: Literal["b64_json"] = "b64_json"
    user: str | None = None
    steps: Annotated[int, Meta(ge=1)] | None = None  # at most serving.max_steps
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0, le=MAX_GUIDANCE_SCALE)] | None = None
    negative_prompt: str | None = None
    attention_backend: str | None = None
    priority: Priority = 0
    timeout: Timeout | None = None
    stream: bool = False
    partial_images: Annotated[int, Meta(ge=0, le=3)] = 0
    lora: dict[str, float | None] | None = None
    """The adapters to run, by name, each at a scale (null: the adapter's own ``scale``)."""
    cache: bool = True
    """Whether its images run the denoiser's step cache, where it has one (design §17): false
    computes every step of them, in the same batch as images that skip steps."""


class ImageReference(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A JSON body's ``input_reference``: the image as a ``data:`` URL (OpenAI's
    ``image_url``; a worker fetches nothing, and keeps no files to name by ``file_id``)."""

    image_url: str


class VideosBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/videos`` (JSON, or a multipart form as the openai client sends
    it), with this worker's extra fields (design §18).

    ``seconds`` (at ``lifecycle.pictures.video.FPS`` frames a second, plus the first) or
    ``num_frames`` sets the length; neither takes the pipeline class's default, as do
    ``size``, ``steps`` and ``guidance_scale`` left out. A multipart form's
    ``input_reference`` is the image file itself.
    """

    prompt: str
    model: str | None = None
    seconds: str | Annotated[float, Meta(gt=0)] | None = None  # OpenAI's are strings: "4"
    num_frames: Annotated[int, Meta(ge=1)] | None = None  # at most serving.max_frames
    size: str | None = None
    input_reference: ImageReference | None = None
    user: str | None = None
    steps: Annotated[int, Meta(ge=1)] | None = None  # at most serving.max_steps
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0, le=MAX_GUIDANCE_SCALE)] | None = None
    guidance_scale_2: Annotated[float, Meta(ge=0, le=MAX_GUIDANCE_SCALE)] | None = None
    negative_prompt: str | None = None
    priority: Priority = 0
    timeout: Timeout | None = None


class PipelineBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/pipelines``: a spec on the worker's disk to admit and load."""

    path: WorkerPath


class AdapterBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/adapters``: an ``[adapters.NAME]`` table with its name, and
    the pipeline (``model``; None: the only one served)."""

    name: Annotated[str, Meta(pattern=NAME_PATTERN, max_length=128)]  # as a spec's names
    model: str | None = None
    path: WorkerPath
    component: str | None = None
    scale: float = 1.0
    mode: Literal["merged", "unmerged"] = "merged"


Body = TypeVar("Body", EmbeddingsBody, ImagesBody, VideosBody, PipelineBody, AdapterBody)

EMBEDDINGS_BODY = msgspec.json.Decoder(EmbeddingsBody)
IMAGES_BODY = msgspec.json.Decoder(ImagesBody)
VIDEOS_BODY = msgspec.json.Decoder(VideosBody)
_AT_FIELD = re.compile(r"at `\$\.(\w+)|field `(\w+)`")
"""The body field a msgspec error names: ``... - at `$.n` `` or ``unknown field `colour` ``."""
_ECHOED = re.compile(
    r"(Object contains unknown field |Invalid enum value )(.*?)((?: - at `\$[^`]*`)?)", re.S
)
"""The msgspec errors that repeat what the client sent: a field's name or an enum value
(in msgspec's quotes), then the path."""


def decode_body(decoder: msgspec.json.Decoder[Body], raw: bytes) -> Body:
    """Decode a request body; a bad one is a 400 naming the field (msgspec's message)."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as err:  # ValidationError included
        raise bad_body(err) from None


def convert_form(fields: dict[str, str], body_type: type[Body]) -> Body:
    """Convert a multipart form's text fields to ``body_type`` (numbers from their text);
    a bad one is a 400 naming the field, as ``decode_body``'s."""
    try:
        return msgspec.convert(fields, body_type, strict=False)
    except msgspec.ValidationError as err:
        raise bad_body(err) from None


def bad_body(err: msgspec.DecodeError) -> ApiError:
    """Return the 400 of a body msgspec could not read: its message, naming the field."""
    message = _cut_echo(str(err))
    # msgspec names the path last, after any value it repeats; a name cut short is no param
    params = [at or field for at, field in _AT_FIELD.findall(message)]
    return ApiError(
        400,
        f"bad request body: {message}",
        param=params[-1] if params else None,
        code="invalid_body",
    )


def _cut_echo(message: str) -> str:
    """Return msgspec's ``message`` with the name or value it repeats cut (``shown``)."""
    found = _ECHOED.fullmatch(message)
    if found is None or len(found[2]) <= SHOWN_CHARS:
        return message
    return found[1] + shown(found[2][1:-1]) + found[3]  # [1:-1]: msgspec's quotes


def documented(body_type: type[msgspec.Struct]) -> dict[str, Any]:
    """Return the OpenAPI ``requestBody`` of a route that decodes ``body_type`` itself."""
    schema = msgspec.json.decode(_schema(body_type))  # a copy of its own for each app
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@functools.cache  # every app the process builds documents the same types (0.8 ms each)
def _schema(body_type: type[msgspec.Struct]) -> bytes:
    """Return ``body_type``'s JSON schema, encoded."""
    _, components = msgspec.json.schema_components([body_type])
    return msgspec.json.encode(components[body_type.__name__])  # flat: no references
