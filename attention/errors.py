"""The exceptions of the attention package; each says what is wrong, why, and the fix."""

from __future__ import annotations

from enum import StrEnum

from attention.plugins import UnknownPluginError

__all__ = ["BackendSelectionError", "NotResidentError", "SelectionCode", "UnknownBackendError"]


class SelectionCode(StrEnum):
    """The refusal codes the attention package raises (a subset of ``lifecycle.RefusalCode``)."""

    CAPABILITY_MISSING = "attention.capability_missing"
    UNSUPPORTED_BACKEND = "attention.unsupported_backend"
    UNAVAILABLE_BACKEND = "attention.unavailable_backend"
    NO_BACKEND = "attention.no_backend"
    BACKEND_NOT_CONSUMED = "attention.backend_not_consumed"
    PLAN_DIVERGED = "attention.plan_diverged"
    RING_REQUIRES_LSE = "parallel.ring_requires_lse"


class BackendSelectionError(Exception):
    """Report that no attention backend may serve a layer, or a scope's request went unmet.

    Attributes:
        code: the stable refusal code.
        component: the component whose layer or scope failed.
        message: what is wrong and why.
        hint: how to fix it.
        rejected: each candidate backend that was tried, mapped to every reason it was
            refused.
    """

    def __init__(
        self,
        code: SelectionCode,
        component: str,
        message: str,
        hint: str,
        rejected: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(f"{message}; fix: {hint}")
        self.code = code
        self.component = component
        self.message = message
        self.hint = hint
        self.rejected = dict(rejected or {})

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.code, self.component, self.message, self.hint, self.rejected),
        )


class UnknownBackendError(UnknownPluginError):
    """Report an attention backend name that is neither built in nor registered.

    Attributes:
        name: the name that was looked up.
        known: every known name, built-ins first.
        failed: entry point -> why it did not load.
    """

    noun = "attention backend"
    fix = "register out-of-tree backends with attention.register_backend"


class NotResidentError(RuntimeError):
    """Report a forward on an attention layer whose component is not resident (not armed).

    Attributes:
        component: the component the layer belongs to.
        site: the layer's attention site.
    """

    def __init__(self, component: str, site: str) -> None:
        super().__init__(
            f"attention layer '{site}' of component '{component}' ran while its component "
            f"is not resident (the layer is disarmed); onload component '{component}' "
            "before running it"
        )
        self.component = component
        self.site = site

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.component, self.site))
