"""The scope a component is constructed in: its requests, its plan, its record.

The scope lives in a ContextVar (never in process-global state), so concurrent or nested
constructions see only their own. A component with an admitted plan hands each layer its
site's planned selection; one without (a generic kind, whose layers are known only once
built) selects per layer and checks on exit that every explicit backend was consumed
(design §4.3).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

import structlog

from attention.consumption import unconsumed
from attention.errors import BackendSelectionError, SelectionCode
from attention.platform import Platform
from attention.request import (
    BackendRequest,
    ComponentRequests,
    PlannedSelection,
    Selection,
    SelectionRecord,
)
from attention.selection import select_backend

__all__ = ["UNSCOPED", "AttentionScope", "component_attention_scope", "current_scope"]

UNSCOPED = "<unscoped>"
_PLANNED_FIELDS = ("role", "requirements", "supported", "layer_default", "layer_backend")

_current: ContextVar[AttentionScope | None] = ContextVar("attention_scope", default=None)
# Loggers are fetched per event, never held from import: structlog caches a logger on
# first use, and an application may configure logging after importing this package.
# These events come once per layer built, so the lookup costs nothing that matters.


class AttentionScope:
    """Carry one component's attention requests while it is constructed, and record them.

    ``component_attention_scope`` yields it; read ``records`` after the scope exits.
    Layers built outside any scope use a throwaway one named ``<unscoped>``.

    Args:
        requests: what the spec asks of the component's attention.
        plan: site -> its admitted selection; when given, layers take it and
            ``select_backend`` does not run again.
        platform: where the layers will run (detected when None).
    """

    def __init__(
        self,
        requests: ComponentRequests,
        *,
        plan: Mapping[str, PlannedSelection] | None = None,
        platform: Platform | None = None,
    ) -> None:
        self.requests = requests
        self.plan = None if plan is None else MappingProxyType(dict(plan))
        self.platform = platform if platform is not None else Platform.detect()
        self._records: list[SelectionRecord] = []

    @property
    def component(self) -> str:
        """Return the name of the component under construction."""
        return self.requests.component

    @property
    def records(self) -> tuple[SelectionRecord, ...]:
        """Return every selection made in this scope, in construction order."""
        return tuple(self._records)

    def resolve(self, request: BackendRequest) -> Selection:
        """Return one layer's backend (planned, else selected), then record and log it.

        Raises:
            BackendSelectionError: selection failed, or (``attention.plan_diverged``) the
                layer is not the site the plan was made from.
        """
        if self.plan is None:
            selection = select_backend(request, self.platform)
        else:
            selection = self._planned(self.plan, request)
        self._records.append(SelectionRecord.of(request, selection))
        structlog.get_logger("attention").info(
            "attention.selected",
            component=self.component,
            site=request.site,
            role=request.role.value,
            backend=selection.backend,
            provenance=selection.provenance.value,
            reason=selection.reason,
        )
        return selection

    def _planned(self, plan: Mapping[str, PlannedSelection], request: BackendRequest) -> Selection:
        planned = plan.get(request.site)
        layer = f"layer '{request.site}' ({request.role.value}) of component '{self.component}'"
        if planned is None:
            raise BackendSelectionError(
                SelectionCode.PLAN_DIVERGED,
                self.component,
                f"{layer} is not in the admitted plan (planned sites: {', '.join(plan) or 'none'})",
                f"declare site '{request.site}' in the component's kind, or build only "
                "declared sites",
            )
        differences = [
            f"{field} {getattr(request, field)!r} (planned {getattr(planned.request, field)!r})"
            for field in _PLANNED_FIELDS
            if getattr(request, field) != getattr(planned.request, field)
        ]
        if differences:
            raise BackendSelectionError(
                SelectionCode.PLAN_DIVERGED,
                self.component,
                f"{layer} differs from the site the plan was made from: {'; '.join(differences)}",
                "build every layer of a site exactly as the component's kind declares it "
                "(role, requirements, supported set, default)",
            )
        return planned.selection

    def summary(self) -> list[str]:
        """List each distinct backend in use, with its fallback reason when there is one."""
        return list(
            dict.fromkeys(
                r.selection.backend
                if r.selection.reason is None
                else f"{r.selection.backend} ({r.selection.reason})"
                for r in self._records
            )
        )


def current_scope() -> AttentionScope | None:
    """Return the innermost active component scope of this context, or None."""
    return _current.get()


@contextmanager
def component_attention_scope(
    requests: ComponentRequests,
    *,
    plan: Mapping[str, PlannedSelection] | None = None,
    platform: Platform | None = None,
) -> Iterator[AttentionScope]:
    """Construct a component's attention layers under its requests; check them on exit.

    The arguments are those of ``AttentionScope``. On exit the scope is reset first, then
    one ``attention.summary`` event is logged, then — for a component without a plan,
    whose requests admission could not check — the consumption check runs. An exception
    from inside propagates unchanged (no check runs) and leaves no scope behind.

    Raises:
        BackendSelectionError: ``attention.backend_not_consumed`` — an explicit
            component-wide or per-role backend was used by no layer, or a layer it
            governs chose another backend without an allowed fallback reason.
    """
    scope = AttentionScope(requests, plan=plan, platform=platform)
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)
        backends = scope.summary()
        component = requests.component
        structlog.get_logger("attention").info(
            "attention.summary",
            component=component,
            layers=len(scope.records),
            backends=backends,
            summary=f"attention backends for {component}: {', '.join(backends) or 'none'}",
        )
    problem = None if plan is not None else unconsumed(requests, scope.records)
    if problem is not None:
        raise problem
