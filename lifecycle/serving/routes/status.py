"""``GET /`` and ``GET /status``: the worker's status page, one self-contained document.

The page is built once a process: its style sheet, its script and the lifecycle diagram (the
SVG ``lifecycle diagram`` writes, drawn from the transition table) are inlined, so
that it loads nothing else. Its content security policy allows exactly those inline
parts (by hash) and the event stream it reads (``GET /v1/events``): the browser fetches
nothing from any other place, and no data is in the document itself.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from lifecycle.pictures import diagrams
from lifecycle.serving.auth import page_door
from lifecycle.serving.worker import Worker

__all__ = ["status_routes"]


def status_routes(worker: Worker) -> APIRouter:
    """Return the status page at ``/`` and ``/status``, guarded by ``serving.status_page``."""
    door = page_door(o.spec.serving.status_page for o in worker.orchestrators)
    router = APIRouter(dependencies=door)
    page, policy = render_page()
    headers = {"content-security-policy": policy, "cache-control": "no-cache"}

    @router.get("/", include_in_schema=False)
    @router.get("/status", include_in_schema=False)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(page, headers=headers)

    return router


@functools.cache  # the package's files and the transition table are fixed while it runs
def render_page() -> tuple[str, str]:
    """Return the page with its parts inlined, and the content security policy that
    allows exactly those parts and the event stream."""
    static = resources.files("lifecycle.serving") / "static"
    style = (static / "status.css").read_text(encoding="utf-8")
    script = (static / "status.js").read_text(encoding="utf-8")
    # one copy of each drawing per pipeline is cloned from the template: no element ids
    lying, upright = (
        diagrams.svg(upright=upright).replace(f' id="{diagrams.DIAGRAM_NAME}"', "", 1)
        for upright in (False, True)
    )
    page = (
        (static / "status.html")
        .read_text(encoding="utf-8")
        .replace("{{style}}", style)
        .replace("{{script}}", script)
        .replace("{{diagram}}", lying)
        .replace("{{diagram_upright}}", upright)
    )
    # the drawings' own <style> is inline too: its hash is allowed beside the page's
    styles = dict.fromkeys([style, *_inline_styles(lying), *_inline_styles(upright)])
    policy = "; ".join(
        [
            "default-src 'none'",
            "connect-src 'self'",
            "script-src " + _hash(script),
            "style-src " + " ".join(_hash(s) for s in styles),
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
        ]
    )
    return page, policy


def _inline_styles(markup: str) -> list[str]:
    parts = markup.split("<style>")[1:]
    return [part.split("</style>", 1)[0] for part in parts]


def _hash(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"
