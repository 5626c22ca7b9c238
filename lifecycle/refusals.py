"""Refusals: why a transition did not happen, and the errors that carry them.

A refusal is decided before anything is touched. A failure happened while the
work ran and was rolled back. Both leave the component in its source state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from lifecycle.states import ComponentState


class Refusal(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reason a transition was refused.

    Attributes:
        code: a stable dotted code from ``REFUSAL_CODES``.
        component: the component the reason is about.
        message: what is wrong, with the numbers.
        hint: what to change to make it pass.
    """

    code: str
    component: str
    message: str
    hint: str


REFUSAL_CODES: Mapping[str, str] = {
    "attention.capability_missing": (
        "an attention site requires a capability (packed varlen, softmax LSE, masks) "
        "that the backend it may use does not implement"
    ),
    "attention.unsupported_backend": (
        "the backend is outside the set an attention layer supports, and the request "
        "may not fall back"
    ),
    "attention.unavailable_backend": (
        "the backend cannot run on this platform (not installed, or needs a GPU)"
    ),
    "attention.no_backend": "no candidate backend was accepted for an attention site",
    "attention.backend_not_consumed": (
        "an explicit component or per-role backend has no attention layer to apply to"
    ),
    "attention.plan_diverged": (
        "a loader built attention layers that differ from the admitted plan (an "
        "undeclared site, a declared site not built, or another backend)"
    ),
    "loader.native_parallel_layout": (
        "the component would load through a native path that cannot honour the "
        "requested parallel layout (tp, sp, ulysses, ring, kv_gather > 1 or FSDP)"
    ),
    "loader.native_explicit_backend": (
        "the component would load through a native path, which cannot consume its "
        "explicit attention backend"
    ),
    "loader.unavailable": (
        "an explicit loader choice names a path the kind does not have or cannot import"
    ),
    "residency.undeclared_use": (
        "an explicit non-resident component is used by no stage, so nothing would onload it"
    ),
    "residency.memory_budget": "onloading would exceed memory.device_budget",
    "residency.in_use": "the component is in use by an open request",
    "residency.not_offloadable": (
        "the component cannot be offloaded the way asked: an offload of a component "
        "kept resident, or layerwise offload of a kind with no block stack"
    ),
    "parallel.invalid_layout": "the parallel layout breaks an invariant across its keys",
    "parallel.ring_requires_lse": (
        "ring attention needs a backend that exposes the softmax log-sum-exp"
    ),
}


class TransitionRefused(Exception):
    """A guard said no: the transition did not start, the state is unchanged.

    Attributes:
        component: the component (for a whole pipeline, the pipeline's name).
        trigger: the trigger that was refused.
        source: the state the component stayed in.
        refusals: every reason, not only the first.
    """

    def __init__(
        self,
        component: str,
        trigger: str,
        source: ComponentState,
        refusals: Iterable[Refusal],
        message: str | None = None,
    ) -> None:
        self.component = component
        self.trigger = trigger
        self.source = source
        self.refusals = tuple(refusals)
        super().__init__(message or self._describe())

    @property
    def codes(self) -> tuple[str, ...]:
        """Return the refusal codes, in the order they were found."""
        return tuple(r.code for r in self.refusals)

    def _describe(self) -> str:
        count = len(self.refusals)
        head = (
            f"{self.trigger} of {self.component!r} refused from state "
            f"{self.source.value!r} ({count} reason{'s' if count != 1 else ''})"
        )
        lines = [head] + [
            f"  {r.component}: {r.code}: {r.message}; fix: {r.hint}" for r in self.refusals
        ]
        return "\n".join(lines)


class InvalidTransition(TransitionRefused):
    """The trigger does not lead anywhere from the component's current state."""

    def __init__(
        self, component: str, trigger: str, source: ComponentState, valid_from: Iterable[str]
    ) -> None:
        allowed = ", ".join(valid_from)
        super().__init__(
            component,
            trigger,
            source,
            (),
            message=(
                f"cannot {trigger} component {component!r} from state {source.value!r}; "
                f"{trigger} is valid from: {allowed}"
            ),
        )


class AdmissionRefused(TransitionRefused):
    """Admission of a whole pipeline was refused; every component stays configured."""

    def __init__(self, pipeline: str, refusals: Iterable[Refusal]) -> None:
        super().__init__(pipeline, "admit", ComponentState.CONFIGURED, refusals)


class TransitionFailed(Exception):
    """The work of a transition raised; what it did was rolled back.

    The cause is chained as ``__cause__``.

    Attributes:
        component: the component whose transition failed.
        trigger: the trigger that failed.
        source: the state the component stayed in.
    """

    def __init__(
        self, component: str, trigger: str, source: ComponentState, cause: BaseException
    ) -> None:
        self.component = component
        self.trigger = trigger
        self.source = source
        super().__init__(
            f"{trigger} of {component!r} failed and was rolled back; it stays "
            f"{source.value!r}: {type(cause).__name__}: {cause}"
        )
