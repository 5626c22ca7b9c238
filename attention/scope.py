"""The scope a component is constructed in: its backend requests, its plan, its record.

The scope lives in a ContextVar (never in process-global state), so concurrent or nested
constructions see only their own. On a clean exit it checks that every explicit
component backend was used (DESIGN §4.3).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

import msgspec
import structlog

from attention.errors import BackendSelectionError
from attention.platform import Platform
from attention.request import (
    DENSE_CROSS_FALLBACK,
    BackendChoice,
    BackendRequest,
    RequestSource,
    Selection,
)
from attention.requirements import AttentionRequirements
from attention.roles import AttentionRole, Provenance
from attention.selection import select_backend

BACKEND_NOT_CONSUMED = "attention.backend_not_consumed"
PLAN_DIVERGED = "attention.plan_diverged"
UNSCOPED = "<unscoped>"

_log = structlog.get_logger("attention")
_current: ContextVar[AttentionScope | None] = ContextVar("attention_scope", default=None)


class SelectionRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Remember one layer's selection inside a scope.

    Attributes:
        site: the layer's attention site.
        role: the layer's role.
        source: the precedence level its request came from.
        requested: the requested backend's name, or None when nothing was requested.
        selection: what was chosen, and why.
    """

    site: str
    role: AttentionRole
    source: RequestSource
    requested: str | None
    selection: Selection


class AttentionScope:
    """Carry one component's attention requests while it is constructed, and record them.

    ``component_attention_scope`` yields it; read ``records`` after the scope exits.
    Layers built outside any scope use a throwaway one named ``<unscoped>``.

    Args:
        component: the component's name, used in every message.
        component_backend: the component-wide override.
        role_backends: the per-role overrides; a role here beats ``component_backend``.
        global_backend: the pipeline's global backend.
        allow_global_fallback: the loader lets an explicit global backend fall back.
        ring: ring attention applies to this component's self-attention layers.
        plan: site -> the selection admitted for it; layers must agree with it.
        platform: where the layers will run (detected when None).
        backend_options: backend name -> its validated options Struct.
    """

    def __init__(
        self,
        component: str,
        *,
        component_backend: BackendChoice | None = None,
        role_backends: Mapping[AttentionRole, BackendChoice] | None = None,
        global_backend: BackendChoice | None = None,
        allow_global_fallback: bool = False,
        ring: bool = False,
        plan: Mapping[str, Selection] | None = None,
        platform: Platform | None = None,
        backend_options: Mapping[str, msgspec.Struct] | None = None,
    ) -> None:
        self.component = component
        self.component_backend = component_backend
        self.role_backends = MappingProxyType(dict(role_backends or {}))
        self.global_backend = global_backend
        self.allow_global_fallback = allow_global_fallback
        self.ring = ring
        self.plan = None if plan is None else MappingProxyType(dict(plan))
        self.platform = platform if platform is not None else Platform.detect()
        self.backend_options = MappingProxyType(dict(backend_options or {}))
        self._records: list[SelectionRecord] = []

    @property
    def records(self) -> tuple[SelectionRecord, ...]:
        """Return every selection made in this scope, in construction order."""
        return tuple(self._records)

    def select(
        self,
        *,
        site: str,
        role: AttentionRole,
        requirements: AttentionRequirements,
        supported: frozenset[str] | None,
        default: str | None,
        backend: str | None,
    ) -> Selection:
        """Choose, check against the plan, record and log one layer's backend.

        Raises:
            BackendSelectionError: selection failed, or (``attention.plan_diverged``) the
                layer's selection differs from the admitted plan for its site.
        """
        request = BackendRequest(
            component=self.component,
            site=site,
            role=role,
            requirements=requirements,
            supported=supported,
            layer_default=default,
            layer_backend=backend,
            role_override=self.role_backends.get(role),
            component_override=self.component_backend,
            global_backend=self.global_backend,
            allow_global_fallback=self.allow_global_fallback,
            ring=self.ring and role is AttentionRole.SELF,
        )
        selection = select_backend(request, self.platform)
        if self.plan is not None:
            self._check_plan(self.plan, site, role, selection)
        requested, source = request.requested()
        self._records.append(
            SelectionRecord(
                site=site,
                role=role,
                source=source,
                requested=None if requested is None else requested.name,
                selection=selection,
            )
        )
        _log.info(
            "attention.selected",
            component=self.component,
            site=site,
            role=role.value,
            backend=selection.backend,
            provenance=selection.provenance.value,
            reason=selection.reason,
        )
        return selection

    def _check_plan(
        self, plan: Mapping[str, Selection], site: str, role: AttentionRole, selection: Selection
    ) -> None:
        planned = plan.get(site)
        layer = f"layer '{site}' ({role.value}) of component '{self.component}'"
        if planned is None:
            raise BackendSelectionError(
                PLAN_DIVERGED,
                self.component,
                f"{layer} is not in the admitted plan (planned sites: {', '.join(plan) or 'none'})",
                f"declare site '{site}' in the component's kind, or build only declared sites",
            )
        if planned.backend != selection.backend:
            raise BackendSelectionError(
                PLAN_DIVERGED,
                self.component,
                f"{layer} selected backend '{selection.backend}', but the admitted plan "
                f"chose '{planned.backend}' for that site",
                "make the site declared by the component's kind match the layer it builds "
                "(role, requirements, supported set, default)",
            )

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

    def unmet(self) -> BackendSelectionError | None:
        """Say which explicit component backend went unused or was overridden, if any."""
        problems = [
            problem
            for choice, roles, source in self._explicit_requests()
            if (problem := self._consumption(choice, roles, source)) is not None
        ]
        if not problems:
            return None
        return BackendSelectionError(
            BACKEND_NOT_CONSUMED,
            self.component,
            "; ".join(message for message, _ in problems),
            "; ".join(dict.fromkeys(hint for _, hint in problems)),
        )

    def _explicit_requests(
        self,
    ) -> list[tuple[BackendChoice, frozenset[AttentionRole], RequestSource]]:
        """List each explicit component request with the roles it governs, component first."""
        requests = []
        if self.component_backend is not None:
            rest = frozenset(AttentionRole) - frozenset(self.role_backends)
            requests.append((self.component_backend, rest, RequestSource.COMPONENT))
        requests += [
            (choice, frozenset({role}), RequestSource.ROLE)
            for role, choice in self.role_backends.items()
        ]
        return [r for r in requests if r[0].provenance is Provenance.EXPLICIT]

    def _consumption(
        self, choice: BackendChoice, roles: frozenset[AttentionRole], source: RequestSource
    ) -> tuple[str, str] | None:
        """Check one explicit request; return (message, hint) when it was not honoured."""
        name, component = choice.name, self.component
        asked = f"backend '{name}' was requested for {_whom(roles, source)} '{component}'"
        governed = [r for r in self._records if r.role in roles]
        remove = f"remove the attention backend requested for component '{component}'"
        if not self._records:
            return (
                f"{asked}, but that component constructed no attention layers",
                f"{remove}: nothing in it can use one",
            )
        if not roles:
            return (
                f"{asked}, but per-role overrides replace it for every role",
                f"{remove}, or drop the per-role overrides it should apply to",
            )
        if not governed:
            built = ", ".join(sorted({r.role.value for r in self._records}))
            return (
                f"{asked}, but that component constructed no {_roles(roles)} layers (only {built})",
                f"{remove}, or request it for a role the component builds",
            )
        for record in governed:
            chosen = record.selection.backend
            # The one fallback an explicit component request may take (DESIGN §4.2).
            fell_back = record.source is source and record.selection.reason == DENSE_CROSS_FALLBACK
            if chosen != name and not fell_back:
                return (
                    f"{asked}, but layer '{record.site}' ({record.role.value}) chose "
                    f"'{chosen}' without an allowed fallback (its request came from the "
                    f"{record.source.value} level)",
                    f"remove the backend the layer's code names, or request '{chosen}' "
                    f"for component '{component}'",
                )
        return None


def _whom(roles: frozenset[AttentionRole], source: RequestSource) -> str:
    if source is RequestSource.ROLE:
        return f"the {_roles(roles)} layers of component"
    return "component"


def _roles(roles: frozenset[AttentionRole]) -> str:
    words = {AttentionRole.SELF: "self-attention", AttentionRole.CROSS: "cross-attention"}
    return " or ".join(words[role] for role in AttentionRole if role in roles)


def current_scope() -> AttentionScope | None:
    """Return the innermost active component scope of this context, or None."""
    return _current.get()


@contextmanager
def component_attention_scope(
    component: str,
    *,
    component_backend: BackendChoice | None = None,
    role_backends: Mapping[AttentionRole, BackendChoice] | None = None,
    global_backend: BackendChoice | None = None,
    allow_global_fallback: bool = False,
    ring: bool = False,
    plan: Mapping[str, Selection] | None = None,
    platform: Platform | None = None,
    backend_options: Mapping[str, msgspec.Struct] | None = None,
) -> Iterator[AttentionScope]:
    """Construct a component's attention layers under its requests; check them on exit.

    The arguments are those of ``AttentionScope``. On exit the scope is reset first, then
    one ``attention.summary`` event is logged, then the consumption check runs. An
    exception from inside propagates unchanged (no check runs) and leaves no scope behind.

    Raises:
        BackendSelectionError: ``attention.backend_not_consumed`` — an explicit
            component-wide or per-role backend was used by no layer, or a layer it
            governs chose another backend without an allowed fallback reason.
    """
    scope = AttentionScope(
        component,
        component_backend=component_backend,
        role_backends=role_backends,
        global_backend=global_backend,
        allow_global_fallback=allow_global_fallback,
        ring=ring,
        plan=plan,
        platform=platform,
        backend_options=backend_options,
    )
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)
        backends = scope.summary()
        _log.info(
            "attention.summary",
            component=component,
            layers=len(scope.records),
            backends=backends,
            summary=f"attention backends for {component}: {', '.join(backends) or 'none'}",
        )
    problem = scope.unmet()
    if problem is not None:
        raise problem
