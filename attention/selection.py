"""Choose one layer's attention backend: a pure function of the request and the platform."""

from __future__ import annotations

from dataclasses import dataclass

from attention import registry
from attention.errors import BackendSelectionError, SelectionCode, UnknownBackendError
from attention.platform import Platform
from attention.request import (
    DENSE_CROSS_FALLBACK,
    GLOBAL_BACKEND_FALLBACK,
    PLATFORM_DEFAULT_FALLBACK,
    BackendRequest,
    RequestSource,
    Selection,
)
from attention.requirements import AttentionRequirements
from attention.roles import AttentionRole, Provenance

__all__ = ["select_backend"]

_CAPABILITY_CODES = (SelectionCode.RING_REQUIRES_LSE, SelectionCode.CAPABILITY_MISSING)


@dataclass(frozen=True)
class _Failure:
    """One reason a candidate was refused; the message is written only if it is reported."""

    name: str
    code: SelectionCode
    why: str
    missing: tuple[str, ...] = ()
    unknown: bool = False
    sparse_on_cross: bool = False


@dataclass(frozen=True)
class _Problem:
    """The request, platform and effective requirements every check reads."""

    request: BackendRequest
    platform: Platform
    needs: AttentionRequirements
    ring_strict: bool

    @property
    def layer(self) -> str:
        r = self.request
        return f"layer '{r.site}' ({r.role.value}) of component '{r.component}'"


def select_backend(request: BackendRequest, platform: Platform) -> Selection:
    """Choose the attention backend for one layer.

    Only the requested backend is tried when its provenance is explicit; other
    provenances walk the fallback chain of design §4.2 (requested, layer default,
    platform default, platform preference, out-of-tree backends).

    Raises:
        BackendSelectionError: nothing was accepted; ``.code`` and ``.rejected`` say why.
    """
    requested, source = request.requested()
    provenance = requested.provenance if requested is not None else Provenance.DEFAULT
    if requested is not None:
        primary = requested.name
    else:
        primary = request.layer_default or platform.default_backend
    needs = request.requirements
    if request.ring:
        needs = AttentionRequirements(
            packed_varlen=needs.packed_varlen,
            softmax_lse=True,
            attention_mask=needs.attention_mask,
        )
    problem = _Problem(
        request, platform, needs, ring_strict=request.ring and provenance is Provenance.EXPLICIT
    )
    first = _check(primary, problem)
    if not first:
        return Selection(backend=primary, reason=None, provenance=provenance)
    refused = [first]
    # A candidate's reasons are in check order: its first one decides, the rest inform.
    reason = _fallback_reason(request, provenance, source, first[0])
    if reason is not None:
        for name in _chain(request, platform, primary):
            failures = _check(name, problem)
            if not failures:
                return Selection(
                    backend=name, reason=reason, provenance=provenance, rejected=_why(refused)
                )
            refused.append(failures)
    raise _error(problem, refused, fell_back=reason is not None)


def _fallback_reason(
    request: BackendRequest, provenance: Provenance, source: RequestSource, failure: _Failure
) -> str | None:
    """Say why the chain may be walked after the first candidate failed, or None if strict."""
    if failure.sparse_on_cross:
        return DENSE_CROSS_FALLBACK
    if failure.code == SelectionCode.RING_REQUIRES_LSE:
        return None
    if provenance is not Provenance.EXPLICIT:
        return PLATFORM_DEFAULT_FALLBACK
    if source is RequestSource.GLOBAL and (
        request.layer_default is not None or request.allow_global_fallback
    ):
        return GLOBAL_BACKEND_FALLBACK
    return None


def _chain(request: BackendRequest, platform: Platform, primary: str) -> list[str]:
    """List the fallback candidates after ``primary``, each once, in design §4.2 order."""
    automatic = [
        platform.default_backend,
        *platform.preference,
        *(cls.name for cls in registry.out_of_tree() if cls.is_automatic and not cls.is_sparse),
    ]
    if request.supported is not None:
        automatic = [name for name in automatic if name in request.supported]
    named = [request.layer_default] if request.layer_default is not None else []
    return [name for name in dict.fromkeys([*named, *automatic]) if name != primary]


def _check(name: str, problem: _Problem) -> tuple[_Failure, ...]:
    """Return every reason backend ``name`` cannot serve the layer; none when it can."""
    request = problem.request
    try:
        backend = registry.get(name)
    except UnknownBackendError:
        return (
            _Failure(
                name, SelectionCode.UNSUPPORTED_BACKEND, "not a registered backend", unknown=True
            ),
        )
    failures: list[_Failure] = []
    if backend.is_sparse and request.role is AttentionRole.CROSS:
        failures.append(
            _Failure(
                name,
                SelectionCode.UNSUPPORTED_BACKEND,
                "sparse, never used for cross-attention",
                sparse_on_cross=True,
            )
        )
    if request.supported is not None and name not in request.supported:
        failures.append(
            _Failure(name, SelectionCode.UNSUPPORTED_BACKEND, "not in the layer's supported set")
        )
    unavailable = problem.platform.unavailable_reason(name)
    if unavailable is not None:
        failures.append(_Failure(name, SelectionCode.UNAVAILABLE_BACKEND, unavailable))
    needs = problem.needs
    if problem.ring_strict and not backend.supports_lse():
        failures.append(
            _Failure(
                name, SelectionCode.RING_REQUIRES_LSE, "no softmax LSE, which ring attention needs"
            )
        )
        needs = request.requirements  # the LSE ring attention adds is reported just above
    missing = backend.unsupported_requirements(needs)
    if missing:
        failures.append(
            _Failure(
                name,
                SelectionCode.CAPABILITY_MISSING,
                f"does not implement {_join(missing)}",
                missing=missing,
            )
        )
    return tuple(failures)


def _why(refused: list[tuple[_Failure, ...]]) -> dict[str, tuple[str, ...]]:
    """Map each refused candidate to every reason it was refused."""
    return {failures[0].name: tuple(f.why for f in failures) for failures in refused}


def _error(
    problem: _Problem, refused: list[tuple[_Failure, ...]], *, fell_back: bool
) -> BackendSelectionError:
    """Report the most useful candidate's first reason: missing capability, else unsupported,
    else none left; ``rejected`` carries every reason of every candidate."""
    rejected = _why(refused)
    failures = [reasons[0] for reasons in refused]
    chosen = next((f for f in failures if f.code in _CAPABILITY_CODES), None) or next(
        (f for f in failures if f.code is SelectionCode.UNSUPPORTED_BACKEND), None
    )
    if chosen is None and not fell_back:
        chosen = failures[0]
    component = problem.request.component
    if chosen is None:
        tried = "; ".join(f"{name}: {' and '.join(whys)}" for name, whys in rejected.items())
        return BackendSelectionError(
            SelectionCode.NO_BACKEND,
            component,
            f"no attention backend can serve {problem.layer} on this {problem.platform.kind} "
            f"platform (tried {', '.join(rejected)})",
            f"make one of the tried backends available ({tried})",
            rejected,
        )
    message, hint = _explain(chosen, problem)
    return BackendSelectionError(chosen.code, component, message, hint, rejected)


def _explain(failure: _Failure, problem: _Problem) -> tuple[str, str]:
    """Write the message (what, why) and the hint (the fix) for one failure."""
    name, layer = failure.name, problem.layer
    request = problem.request
    for_component = f"for component '{request.component}'"
    if failure.code == SelectionCode.RING_REQUIRES_LSE:
        return (
            f"backend '{name}' does not implement softmax LSE, which ring attention on "
            f"{layer} requires",
            f"pick a backend with softmax LSE ({_capable(problem)}) {for_component}, "
            "or run it without ring attention (ring degree 1)",
        )
    if failure.code == SelectionCode.CAPABILITY_MISSING:
        ring = (
            " (ring attention merges partial results with it)"
            if request.ring and not request.requirements.softmax_lse
            else ""
        )
        return (
            f"backend '{name}' does not implement {_join(failure.missing)}, which {layer} "
            f"requires{ring}",
            f"pick a backend that implements {_join(failure.missing)} ({_capable(problem)}) "
            f"{for_component}",
        )
    if failure.unknown:
        return (
            f"backend '{name}' is not a registered attention backend, so {layer} cannot use it",
            f"pick a known backend ({', '.join(registry.names())}) {for_component}, or "
            f"register '{name}' with attention.register_backend",
        )
    if failure.sparse_on_cross:
        return (
            f"sparse backend '{name}' is never used for cross-attention ({layer})",
            f"pick a dense backend ({_capable(problem)}) for the cross role {for_component}",
        )
    if failure.code == SelectionCode.UNSUPPORTED_BACKEND:
        supported = ", ".join(sorted(request.supported or ()))
        return (
            f"backend '{name}' is not supported by this attention layer ({layer}); "
            f"supported: [{supported}]",
            f"pick one of {supported} {for_component}",
        )
    return (
        f"backend '{name}' is not available on this {problem.platform.kind} platform "
        f"({failure.why}), which {layer} was asked to use",
        f"pick an available backend ({_capable(problem)}) {for_component}",
    )


def _capable(problem: _Problem) -> str:
    """List the registered backends that would serve this layer here, or say none would."""
    fit = [name for name in registry.names() if not _check(name, problem)]
    return ", ".join(fit) if fit else "none is available on this platform"


def _join(words: tuple[str, ...]) -> str:
    return " and ".join(words)
