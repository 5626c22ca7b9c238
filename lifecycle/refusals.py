"""Refusals: why a transition did not happen, and the errors that carry them.

A refusal is decided before anything is touched. A failure happened while the
work ran and was rolled back. Both leave the component in its source state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType

import msgspec

from attention import SelectionCode
from lifecycle.machines.tables import AnyState, ComponentState

__all__ = [
    "REFUSAL_CODES",
    "AdmissionRefused",
    "InvalidTransition",
    "Refusal",
    "RefusalCode",
    "Refused",
    "RequestRefused",
    "TransitionFailed",
    "TransitionRefused",
]


class RefusalCode(StrEnum):
    """Every stable refusal code (design §7), one closed set; the docs derive from it.

    Each member's docstring says what it means; ``from_spec`` says whether admission
    can produce it from a spec of the built-in kinds alone (``examples/refused/`` holds
    one such spec per code), as opposed to only while a transition runs.
    """

    from_spec: bool

    def __new__(cls, value: str, from_spec: bool, doc: str) -> RefusalCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.from_spec = from_spec
        member.__doc__ = doc
        return member

    CAPABILITY_MISSING = (
        SelectionCode.CAPABILITY_MISSING.value,
        True,
        "an attention site requires a capability (packed varlen, softmax LSE, masks, an "
        "additive bias, causal attention) that the backend it may use does not implement",
    )
    UNSUPPORTED_BACKEND = (
        SelectionCode.UNSUPPORTED_BACKEND.value,
        True,
        "the backend is outside the set an attention layer supports, and the request "
        "may not fall back",
    )
    UNAVAILABLE_BACKEND = (
        SelectionCode.UNAVAILABLE_BACKEND.value,
        True,
        "the backend cannot run on this platform (not installed, or needs a GPU)",
    )
    NO_BACKEND = (
        SelectionCode.NO_BACKEND.value,
        False,
        "no candidate backend was accepted for an attention site (only a kind whose "
        "supported set the platform cannot serve at all gets here)",
    )
    BACKEND_NOT_CONSUMED = (
        SelectionCode.BACKEND_NOT_CONSUMED.value,
        True,
        "an explicit component or per-role backend has no attention layer to apply to, "
        "or backend options were given for a backend no planned site runs",
    )
    PLAN_DIVERGED = (
        SelectionCode.PLAN_DIVERGED.value,
        False,
        "a loader built attention layers that differ from the admitted plan (an "
        "undeclared site, a declared site not built, or a layer unlike its site)",
    )
    RING_REQUIRES_LSE = (
        SelectionCode.RING_REQUIRES_LSE.value,
        True,
        "ring attention needs a backend that exposes the softmax log-sum-exp",
    )
    NATIVE_PARALLEL_LAYOUT = (
        "loader.native_parallel_layout",
        True,
        "the component would load through a native path that cannot honour the "
        "requested parallel layout (tp, sp, ulysses, ring, kv_gather > 1 or FSDP)",
    )
    NATIVE_EXPLICIT_BACKEND = (
        "loader.native_explicit_backend",
        True,
        "the component would load through a native path, which cannot consume its "
        "explicit attention backend",
    )
    LOADER_UNAVAILABLE = (
        "loader.unavailable",
        True,
        "no loading path can build the component here: an explicit path the kind lacks "
        "or cannot import, a missing weights file, a weights variant its folder lacks, a "
        "CUDA device that is not there, or a dtype the kind or the device cannot run",
    )
    UNSAFE_WEIGHTS = (
        "loader.unsafe_weights",
        True,
        "a folder's component holds its weights only in pickled files (.bin, .pt), which "
        "are never read: loading them would run code from the file",
    )
    UNDECLARED_USE = (
        "residency.undeclared_use",
        True,
        "an explicit non-resident component is used by no stage, so nothing would onload it",
    )
    MEMORY_BUDGET = (
        "residency.memory_budget",
        True,
        "onloading would exceed memory.device_budget; admission refuses a stage that can never fit",
    )
    IN_USE = (
        "residency.in_use",
        False,
        "the component is in use by an open request",
    )
    NOT_OFFLOADABLE = (
        "residency.not_offloadable",
        True,
        "the component cannot be offloaded the way asked: an offload of a component "
        "kept resident, or layerwise offload of a kind with no block stack to stream (none "
        "declared, or one that is not an nn.ModuleList)",
    )
    INVALID_LAYERWISE = (
        "residency.invalid_layerwise",
        True,
        "the layerwise settings ask for more than the component's block stack has",
    )
    OFFLOAD_DIR_UNUSABLE = (
        "residency.offload_dir_unusable",
        True,
        "a component offloads to disk, and memory.offload_dir cannot be created or written "
        "there (a name too long, a read-only or virtual file system, a file in the way, "
        "no permission)",
    )
    HOST_MEMORY = (
        "residency.host_memory",
        True,
        "the declared weights the host must hold at once (every component with the host "
        "target; with the disk target the resident ones and the largest offloaded one) "
        "exceed the memory the host has available",
    )
    INTERFACE_MISMATCH = (
        "pipeline.interface_mismatch",
        True,
        "a component reads a Batch field (context, latents, images) at a width other "
        "than the one the component before it in the stages writes",
    )
    WEIGHTS_MISMATCH = (
        "loader.weights_mismatch",
        True,
        "the weights file's header does not match the kind's declared tensors: a missing "
        "or unexpected name, another shape, or a dtype that is not floating point",
    )
    INVALID_OVERRIDE = (
        "attention.invalid_override",
        False,
        "a request's attention_backend cannot switch the pipeline's switchable sites: "
        "an unknown or sparse backend, no switchable site, or one that would fall back",
    )
    PIPELINE_ASLEEP = (
        "pipeline.asleep",
        False,
        "a component of a sleeping pipeline (one it shares with no pipeline that is awake) "
        "was to be onloaded; wake the pipeline first (or let serving.auto_wake do it)",
    )
    ADAPTER_TARGET_MISMATCH = (
        "adapter.target_mismatch",
        True,
        "an adapter's file does not fit its component: a key names no linear layer of it, "
        "a matrix's shape does not fit the layer, or the A and B matrices of a layer "
        "disagree on the rank",
    )
    ADAPTER_OFFLOADED_COMPONENT = (
        "adapter.offloaded_component",
        True,
        "a merged adapter names a component that leaves the device (component or layerwise "
        "offload, or eviction under a budget when not explicitly resident): its weights "
        "would come back from the offload copy, which holds the base",
    )
    ADAPTER_SHARDED_COMPONENT = (
        "adapter.sharded_component",
        True,
        "an adapter names a component the layout shards (tensor parallel or FSDP): its "
        "file holds whole matrices, not this rank's shards",
    )
    ADAPTER_NATIVE_UNSUPPORTED = (
        "adapter.native_unsupported",
        True,
        "an adapter targets a layer that the component's native path does not build as a "
        "linear layer (it fuses it, as nn.MultiheadAttention fuses q, k and v), so no LoRA "
        "can apply there",
    )
    INVALID_LAYOUT = (
        "parallel.invalid_layout",
        True,
        "the parallel layout breaks an invariant across its keys, or cannot run here",
    )
    UNSUPPORTED_CLASS = (
        "pipeline.unsupported_class",
        True,
        "a folder's pipeline class has no recipe here, or one of its components has a "
        "class no installed kind loads",
    )
    CUSTOM_CODE = (
        "pipeline.custom_code",
        True,
        "a folder's model_index.json names a module shipped in the folder: code that is "
        "never imported (no trust_remote_code)",
    )
    CACHE_UNSUPPORTED = (
        "acceleration.cache_unsupported",
        True,
        "a component has a step cache (design §17) that its loading path cannot honour: "
        "its kind has no denoising block stack (a text encoder, a VAE), or it loads "
        "through a native class and diffusers' own cache hook cannot run it as written (the "
        "class has none, or the method or a warm-up, final or max_skipped value is not "
        "what diffusers' FirstBlockCache does)",
    )
    CACHE_STEPS = (
        "acceleration.cache_steps",
        True,
        "a step cache's warm-up and final steps take every one of the pipeline's default "
        "denoising steps, so the cache could never skip one",
    )
    COMPILER_MISSING = (
        "acceleration.compiler_missing",
        True,
        "a component is compiled (compile = blocks or whole) on a CPU device, where "
        "inductor builds C++, and the compiler it runs (CXX, else g++ on PATH) is missing "
        "or cannot build a one-line file",
    )
    NOT_COMPILABLE = (
        "acceleration.not_compilable",
        True,
        "a component's compile mode cannot run on it: blocks on a kind with no block stack, "
        "whole with an explicit attention backend whose kernel cannot be traced, or a "
        "component the layout splits across ranks",
    )
    MISSING_PACKAGE = (
        "acceleration.missing_package",
        True,
        "a component asks for an acceleration whose optional package is not installed "
        "(quantization needs torchao, the [accel] extra)",
    )
    QUANTIZED_SPLIT = (
        "parallel.quantized_split",
        True,
        "the layout splits a quantized component's weights across ranks (tensor parallel or "
        "FSDP), which is not built for quantized weights",
    )
    ADAPTER_QUANTIZED_COMPONENT = (
        "adapter.quantized_component",
        True,
        "a merged adapter names a quantized component: merging into int8 or float8 weights "
        "rounds them, so unmerging could not put the base back bit for bit",
    )


REFUSAL_CODES: Mapping[str, str] = MappingProxyType(
    {code.value: code.__doc__ or "" for code in RefusalCode}
)
"""Each code's value mapped to what it means (derived from ``RefusalCode``)."""


class Refusal(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reason a transition was refused.

    Attributes:
        code: a stable dotted code.
        component: the component the reason is about.
        message: what is wrong, with the numbers.
        hint: what to change to make it pass.
    """

    code: RefusalCode
    component: str
    message: str
    hint: str


class Refused(Exception):
    """Something was refused before anything happened; the reasons say why and how to fix it.

    The base of ``TransitionRefused`` (a component's trigger) and ``RequestRefused``
    (a whole request, before it runs): catch it to handle either.

    Attributes:
        refusals: every reason, not only the first.
    """

    def __init__(self, refusals: Iterable[Refusal], message: str) -> None:
        self.refusals = tuple(refusals)
        super().__init__(message)

    @property
    def codes(self) -> tuple[RefusalCode, ...]:
        """Return the refusal codes, in the order they were found."""
        return tuple(r.code for r in self.refusals)


class TransitionRefused(Refused):
    """A guard said no: the transition did not start, the state is unchanged.

    Attributes:
        component: the component (for a whole pipeline, the pipeline's name; for an
            adapter, the adapter's).
        trigger: the trigger that was refused.
        source: the state the component (or the pipeline, or the adapter) stayed in.
        refusals: every reason, not only the first.
    """

    def __init__(
        self,
        component: str,
        trigger: str,
        source: AnyState,
        refusals: Iterable[Refusal],
        message: str | None = None,
    ) -> None:
        self.component = component
        self.trigger = trigger
        self.source = source
        found = tuple(refusals)
        super().__init__(found, message or self._describe(found))

    def _describe(self, refusals: tuple[Refusal, ...]) -> str:
        count = len(refusals)
        head = (
            f"{self.trigger} of {self.component!r} refused from state "
            f"{self.source.value!r} ({count} reason{'s' if count != 1 else ''})"
        )
        return "\n".join([head, *(f"  {_reason(r)}" for r in refusals)])


class RequestRefused(Refused):
    """A request was refused before anything ran or was switched.

    Attributes:
        refusals: every reason.
    """

    def __init__(self, refusals: Iterable[Refusal]) -> None:
        found = tuple(refusals)
        super().__init__(
            found,
            "request refused: " + "; ".join(_reason(r) for r in found),
        )


def _reason(refusal: Refusal) -> str:
    return f"{refusal.component}: {refusal.code}: {refusal.message}; fix: {refusal.hint}"


class InvalidTransition(TransitionRefused):
    """The trigger does not lead anywhere from the current state.

    Args:
        component: the component, the pipeline or the adapter.
        trigger: the trigger fired.
        source: the state it is in.
        valid_from: the states the trigger is valid from.
        noun: what ``component`` names (``component``, ``pipeline`` or ``adapter``).
    """

    def __init__(
        self,
        component: str,
        trigger: str,
        source: AnyState,
        valid_from: Iterable[str],
        *,
        noun: str = "component",
    ) -> None:
        allowed = ", ".join(valid_from)
        super().__init__(
            component,
            trigger,
            source,
            (),
            message=(
                f"cannot {trigger} {noun} {component!r} from state {source.value!r}; "
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
        self, component: str, trigger: str, source: AnyState, cause: BaseException
    ) -> None:
        self.component = component
        self.trigger = trigger
        self.source = source
        super().__init__(
            f"{trigger} of {component!r} failed and was rolled back; it stays "
            f"{source.value!r}: {type(cause).__name__}: {cause}"
        )
