"""Whether a component's explicit backends were consumed: one rule for plans and scopes.

Admission applies it to the sites a kind declares, and a scope to the layers a
generic component built; both read the same messages (design §4.3).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from attention.errors import BackendSelectionError, SelectionCode
from attention.request import (
    DENSE_CROSS_FALLBACK,
    BackendChoice,
    ComponentRequests,
    RequestSource,
    SelectionRecord,
)
from attention.roles import AttentionRole, Provenance

__all__ = ["unconsumed"]

_ROLE_WORDS = {AttentionRole.SELF: "self-attention", AttentionRole.CROSS: "cross-attention"}


def unconsumed(
    requests: ComponentRequests,
    records: Sequence[SelectionRecord],
    *,
    built_roles: Iterable[AttentionRole] | None = None,
) -> BackendSelectionError | None:
    """Say which explicit component or per-role backend governs no layer, or was overridden.

    A request is consumed by every layer of the roles it governs that selected it, or
    fell back from it with the one reason an explicit component request may take
    (a sparse backend made dense on cross-attention). Automatic requests are exempt.

    Args:
        requests: what the spec asked of the component.
        records: the selections of the layers (or planned sites) it builds.
        built_roles: every role the component builds; by default those of ``records``
            (admission adds the roles of sites whose selection was refused).
    """
    roles_built = frozenset(r.role for r in records) | frozenset(built_roles or ())
    problems = [
        problem
        for choice, roles, source in _explicit_requests(requests)
        if (problem := _consumption(requests, records, roles_built, choice, roles, source))
    ]
    if not problems:
        return None
    return BackendSelectionError(
        SelectionCode.BACKEND_NOT_CONSUMED,
        requests.component,
        "; ".join(message for message, _ in problems),
        "; ".join(dict.fromkeys(hint for _, hint in problems)),
    )


def _explicit_requests(
    requests: ComponentRequests,
) -> list[tuple[BackendChoice, frozenset[AttentionRole], RequestSource]]:
    """List each explicit component request with the roles it governs, component first."""
    found = []
    if requests.component_backend is not None:
        rest = frozenset(AttentionRole) - frozenset(requests.role_backends)
        found.append((requests.component_backend, rest, RequestSource.COMPONENT))
    found += [
        (choice, frozenset({role}), RequestSource.ROLE)
        for role, choice in requests.role_backends.items()
    ]
    return [r for r in found if r[0].provenance is Provenance.EXPLICIT]


def _consumption(
    requests: ComponentRequests,
    records: Sequence[SelectionRecord],
    roles_built: frozenset[AttentionRole],
    choice: BackendChoice,
    roles: frozenset[AttentionRole],
    source: RequestSource,
) -> tuple[str, str] | None:
    """Check one explicit request; return (message, hint) when it was not honoured."""
    name, component = choice.name, requests.component
    asked = f"backend '{name}' was requested for {_whom(roles, source)} '{component}'"
    remove = f"remove the attention backend requested for component '{component}'"
    if not roles_built:
        return (
            f"{asked}, but that component constructed no attention layers",
            f"{remove}: nothing in it can use one",
        )
    if not roles:
        return (
            f"{asked}, but per-role overrides replace it for every role",
            f"{remove}, or drop the per-role overrides it should apply to",
        )
    if not roles & roles_built:
        built = ", ".join(role.value for role in AttentionRole if role in roles_built)
        shadowed = (
            f", and per-role overrides replace it for {_roles(roles_built)} layers"
            if source is RequestSource.COMPONENT and requests.role_backends
            else ""
        )
        return (
            f"{asked}, but that component constructed no {_roles(roles)} layers "
            f"(only {built}){shadowed}",
            f"{remove}, or request it for a role the component builds",
        )
    for record in records:
        if record.role not in roles:
            continue
        chosen = record.selection.backend
        # The one fallback an explicit component request may take (design §4.2).
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
    return " or ".join(_ROLE_WORDS[role] for role in AttentionRole if role in roles)
