"""Errors answered as OpenAI's error object."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

__all__ = ["ApiError", "add_error_handler", "error_response", "server_error", "server_error_body"]


class ApiError(Exception):
    """An error answered as OpenAI's error object.

    Args:
        status: the HTTP status.
        message: what is wrong and how to fix it.
        kind: OpenAI's error ``type``.
        code: a stable code (a refusal code where there is one).
        param: the body field at fault, if any.
        extra: more fields for the error object (e.g. the refusals).
        headers: response headers it needs (a 401's ``www-authenticate``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = {"message": message, "type": kind, "param": param, "code": code}
        self.body.update(extra or {})


def add_error_handler(app: FastAPI) -> None:
    """Answer every ``ApiError`` as OpenAI's error object (429 and 503 say when to retry)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return error_response(err)


def error_response(err: ApiError) -> JSONResponse:
    """Return ``err`` as OpenAI's error object; 429 and 503 say when to retry."""
    headers = {"retry-after": "1", **err.headers} if err.status in (429, 503) else err.headers
    return JSONResponse({"error": err.body}, status_code=err.status, headers=headers)


def server_error(err: Exception) -> JSONResponse:
    return JSONResponse({"error": server_error_body(err)}, status_code=500)


def server_error_body(err: Exception) -> dict[str, Any]:
    """Return the error object of an exception no handler answered."""
    return {
        "message": f"{type(err).__name__}: {err}",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
