"""The per-request backend override (design §4.6): which backend this request's layers run.

A request that names ``attention_backend`` sets it here for as long as it runs; a
switchable layer reads it on each forward and runs the impl it prepared for that
backend. A ContextVar, never process-global state: two requests on two threads each
see their own override, and a request without one sees None.
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["REQUEST_BACKEND", "UnpreparedBackendError"]

REQUEST_BACKEND: ContextVar[str | None] = ContextVar("request_backend", default=None)
"""The backend the running request asked for, or None (the spec's choices).

Whoever runs a request sets it, and resets it by its token when the request ends.
"""


class UnpreparedBackendError(RuntimeError):
    """A switchable layer ran under an override it was not prepared for.

    Args:
        component: the layer's component.
        site: the layer's site.
        backend: the requested backend.
    """

    def __init__(self, component: str, site: str, backend: str) -> None:
        super().__init__(
            f"layer '{site}' of component '{component}' was asked to run backend "
            f"'{backend}' for this request, but it was never prepared for it; open the "
            "request through Orchestrator.request(attention_backend=...), which "
            "validates and prepares the override first"
        )
