"""The worker's locked door: bearer keys for the ``/v1`` routes and the admin routes.

Routes opt in with one line, ``dependencies=API_KEY`` or ``dependencies=ADMIN``:

- ``require_api_key``: with an API key configured (``--api-key`` or
  ``LIFECYCLE_API_KEY``), a request must carry ``Authorization: Bearer <key>``
  (the admin key is accepted too); a missing or wrong one is a 401 error object.
- ``require_admin``: routes that change pipelines or adapters need the admin key
  (``--admin-key`` or ``LIFECYCLE_ADMIN_KEY``), sent the same way; without one
  configured they are disabled (403, saying how to enable them), and a missing or
  wrong key is a 401.

The status page and its event stream (``GET /``, ``/status``, ``GET /v1/events``)
show every client's request ids, their begin and end and the moves they caused; they
follow ``serving.status_page`` (``page_access``). Once the worker has an API key they
are behind it, unless every spec says ``open`` explicitly (a browser's
``EventSource`` sends no header); ``private`` needs the key, and is closed (403) while
the worker has none. ``/healthz``, ``/readyz`` and ``/metrics`` take no key.

Keys are kept only as SHA-256 digests, compared with ``hmac.compare_digest``
(constant time, whatever the offered key's length), and print as ``<hidden>``: no
log line, traceback or repr can carry one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from fastapi import Depends, Request
from fastapi.params import Depends as Dependency
from msgspec import UnsetType

from lifecycle.serving.errors import ApiError
from lifecycle.spec.structs import StatusPage

__all__ = ["ADMIN", "API_KEY", "DoorKeys", "PageAccess", "page_access", "page_door"]

API_KEY_VARIABLE = "LIFECYCLE_API_KEY"
ADMIN_KEY_VARIABLE = "LIFECYCLE_ADMIN_KEY"
_CHALLENGE = {"www-authenticate": "Bearer"}


class Secret:
    """A key the worker checks offered keys against; it never shows itself.

    Args:
        value: the key (kept only as its SHA-256 digest).
    """

    __slots__ = ("_digest",)

    def __init__(self, value: str) -> None:
        self._digest = _digest(value)

    def matches(self, offered: str) -> bool:
        """Tell whether ``offered`` is the key, in time independent of both."""
        return hmac.compare_digest(self._digest, _digest(offered))

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__


@dataclass(frozen=True)
class DoorKeys:
    """The keys the worker's routes check; None: that door is not locked (or not built).

    Attributes:
        api: the key every ``/v1`` route requires.
        admin: the key the admin routes require; without it they are disabled.
    """

    api: Secret | None = None
    admin: Secret | None = None

    @classmethod
    def from_options(
        cls, api_key: str | None, admin_key: str | None, environ: Mapping[str, str] = os.environ
    ) -> DoorKeys:
        """Return the keys given as options, else those in the environment variables.

        Raises:
            ValueError: a key is empty (it would lock nothing), naming its option.
        """
        keys = {}
        for option, given, variable in (
            ("--api-key", api_key, API_KEY_VARIABLE),
            ("--admin-key", admin_key, ADMIN_KEY_VARIABLE),
        ):
            value = given if given is not None else environ.get(variable)
            if value is not None and not value.strip():
                raise ValueError(
                    f"{option} (or {variable}) is empty; give a key, or leave both unset"
                )
            keys[option] = None if value is None else Secret(value)
        return cls(api=keys["--api-key"], admin=keys["--admin-key"])


def require_api_key(request: Request) -> None:
    """Let the request through with the API key (or the admin key), or when none is set.

    Raises:
        ApiError: 401, the key is missing or wrong.
    """
    keys = _keys(request)
    if keys.api is None:
        return
    offered = _bearer(request)
    # both compared, always: how long this takes says nothing about which key matched
    accepted = [key.matches(offered) for key in (keys.api, keys.admin) if key is not None]
    if not any(accepted):
        raise _unauthorized(offered, "API key", "--api-key", API_KEY_VARIABLE)


def require_admin(request: Request) -> None:
    """Let the request through with the admin key.

    Raises:
        ApiError: 403, the worker has no admin key (the admin routes are disabled);
            401, the key is missing or wrong.
    """
    admin = _keys(request).admin
    if admin is None:
        raise ApiError(
            403,
            "the admin routes are disabled on this worker; start it with --admin-key KEY "
            f"(or {ADMIN_KEY_VARIABLE}) and send Authorization: Bearer KEY to use them",
            kind="permission_error",
            code="admin_disabled",
        )
    offered = _bearer(request)
    if not admin.matches(offered):
        raise _unauthorized(offered, "admin key", "--admin-key", ADMIN_KEY_VARIABLE)


PageAccess: TypeAlias = Literal["open", "api_key", "closed"]
"""Who may read the status page and its stream: every client, holders of the API key
(or the admin key), or no one (``private`` on a worker without an API key)."""


def page_access(status_pages: Iterable[StatusPage | UnsetType], keys: DoorKeys) -> PageAccess:
    """Return who may read the status page, given each pipeline's ``serving.status_page``.

    One page shows every pipeline, so it is private when any says so, and open on a
    locked worker only when every one says ``open`` explicitly: the page shows other
    clients' request ids and moves, which a key is meant to keep from strangers.
    """
    pages = set(status_pages)
    if "private" in pages:
        return "closed" if keys.api is None else "api_key"
    if keys.api is None or pages == {"open"}:
        return "open"
    return "api_key"


def page_door(status_pages: Iterable[StatusPage | UnsetType]) -> list[Dependency]:
    """Return the dependencies of the status page and its event stream, given each
    pipeline's ``serving.status_page`` (``page_access`` decides, with the app's keys)."""
    pages = tuple(status_pages)

    def require_page(request: Request) -> None:
        access = page_access(pages, _keys(request))
        if access == "closed":
            raise ApiError(
                403,
                'serving.status_page is "private", but the worker has no API key: start it '
                f"with --api-key KEY (or {API_KEY_VARIABLE}) and send Authorization: Bearer "
                'KEY, or set serving.status_page = "open"',
                kind="permission_error",
                code="status_page_private",
            )
        if access == "api_key":
            require_api_key(request)

    return [Depends(require_page)]


API_KEY: list[Dependency] = [Depends(require_api_key)]
"""``dependencies=API_KEY`` on a ``/v1`` route: it needs the API key when one is set."""

ADMIN: list[Dependency] = [Depends(require_admin)]
"""``dependencies=ADMIN`` on a route that changes pipelines or adapters."""


def _keys(request: Request) -> DoorKeys:
    keys = getattr(request.app.state, "door", None)
    return keys if isinstance(keys, DoorKeys) else DoorKeys()


def _bearer(request: Request) -> str:
    """Return the bearer token of ``Authorization``; empty when there is none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _unauthorized(offered: str, what: str, option: str, variable: str) -> ApiError:
    # the offered key is never repeated: a response may be logged where a key must not be
    found = "a wrong" if offered else "no"
    return ApiError(
        401,
        f"this worker requires its {what}: the request carried {found} bearer token; send "
        f"Authorization: Bearer KEY with the key the worker was started with ({option} or "
        f"{variable})",
        code="invalid_api_key",
        headers=_CHALLENGE,
    )


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()
