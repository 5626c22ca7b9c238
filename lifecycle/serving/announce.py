"""What ``lifecycle serve`` says to a person: one line when it is ready, one when it drains.

At the default log level the worker logs nothing while all goes well; like uvicorn's
"running on" line and vLLM's, these say that it serves, where, with which pipelines,
whether its doors are locked (never a key) and who may read its status page, then that
it stops. They are text for a person on stderr: ``serve`` leaves them out when JSON
logs are asked for (``--log-format json``), whose ``serving.listening``,
``serving.ready`` and ``serving.draining`` events carry the same facts at info.
"""

from __future__ import annotations

from collections.abc import Sequence

from lifecycle.serving.auth import DoorKeys, PageAccess

__all__ = ["base_url", "draining_line", "ready_line"]


def base_url(host: str, port: int) -> str:
    """Return the URL of a worker listening on ``host:port`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ready_line(url: str, pipelines: Sequence[str], keys: DoorKeys, page: PageAccess) -> str:
    """Return the line that says the worker at ``url`` serves ``pipelines``.

    Args:
        url: the worker's base URL (``base_url``).
        pipelines: the names of the pipelines it serves.
        keys: its keys; the line says only whether each is set.
        page: who may read the status page (``auth.page_access``, the door's own rule).
    """
    api = "API key set" if keys.api is not None else "no API key"
    admin = "admin key set" if keys.admin is not None else "no admin key (admin routes off)"
    readers = {
        # open on a locked worker only when every spec says so: say that it was asked for
        "open": 'open to every client: serving.status_page = "open"'
        if keys.api is not None
        else "open",
        "api_key": "behind the API key",
        "closed": 'closed: serving.status_page = "private" needs --api-key',
    }[page]
    return (
        f"lifecycle serve: ready on {url}, pipeline{'s' * (len(pipelines) != 1)} "
        f"{', '.join(pipelines)}; {api}, {admin}; status page {url}/ ({readers})"
    )


def draining_line(signal: str, unfinished: int) -> str:
    """Return the line that says the worker drains on ``signal`` with ``unfinished`` jobs."""
    jobs = (
        f"the {unfinished} request{'s' * (unfinished != 1)} queued or running finish first "
        "(within serving.drain_timeout)"
        if unfinished
        else "nothing is queued or running"
    )
    return (
        f"lifecycle serve: draining on {signal}: new requests get 503, {jobs}; then every "
        "pipeline is released and it exits"
    )
