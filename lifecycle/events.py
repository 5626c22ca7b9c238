"""What the orchestrator observes, as typed values, and who receives them.

Each fact the orchestrator logs (design §9) is also a frozen Struct here, tagged with
its log event's name, so that it encodes to the same JSON object a log line carries.
Observers attached to an orchestrator receive every one of them: the CLI's move tally
and timeline, the HTTP worker's metrics. With none attached, the orchestrator builds
no event at all.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

import msgspec

from components.cache import CacheSteps
from lifecycle.logs import get_logger

__all__ = [
    "AdapterSwitched",
    "AdapterTransitioned",
    "Direction",
    "Event",
    "MemoryWait",
    "Move",
    "MoveReason",
    "Observer",
    "Observers",
    "PipelineReloaded",
    "PipelineRestored",
    "PipelineSlept",
    "PipelineSwapped",
    "PipelineTransitioned",
    "PipelineWoke",
    "PromptCounts",
    "ReloadOutcome",
    "RequestBegan",
    "RequestCancelled",
    "RequestEnded",
    "Transitioned",
    "TriggerRefused",
]

log = get_logger("lifecycle")

Direction: TypeAlias = Literal["onload", "offload"]
MoveReason: TypeAlias = Literal["prefetch"]
"""Why a component moved when no stage of its own asked for it (``Move.reason``)."""

ReloadOutcome: TypeAlias = Literal["unchanged", "swapped", "refused", "restored"]


class Move(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="residency.moved",
    omit_defaults=True,
):
    """One movement of a component's weights (``residency.moved``).

    Attributes:
        component: the component that moved.
        direction: onto the device, or off it.
        target: where offloaded weights live (host or disk).
        bytes: the bytes moved (the accounted bytes where nothing needs to move).
        seconds: how long the move took.
        request_id: the request it happened for, or None.
        at: seconds since the orchestrator started, when the move finished.
        streamed: on the offload of a layerwise component, the bytes of its blocks that
            streamed onto the device and off while it was resident (blocks a step cache
            skipped streamed none); 0, and left out, otherwise.
        reason: why it moved when no stage of its own asked for it: ``prefetch`` (onloaded
            for the next request while this one runs its last stage); None, and left out,
            otherwise.
    """

    component: str
    direction: Direction
    target: str
    bytes: int
    seconds: float
    request_id: str | None
    at: float
    streamed: int = 0
    reason: MoveReason | None = None


class Transitioned(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="lifecycle.transition",
):
    """A component went from one state to another (``lifecycle.transition``).

    Attributes:
        component: the component.
        trigger: what moved it.
        source: the state it left (lower-case value).
        dest: the state it entered.
        duration_ms: how long the transition took, guards and work together.
        request_id: the request it happened for, or None.
    """

    component: str
    trigger: str
    source: str
    dest: str
    duration_ms: float
    request_id: str | None


class TriggerRefused(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="lifecycle.refused"
):
    """A guard said no: the component stayed where it was (``lifecycle.refused``).

    Named apart from the exception ``lifecycle.Refused`` that ``TransitionRefused`` and
    ``RequestRefused`` derive from; its old name here, ``Refused``, still imports, with a
    ``DeprecationWarning``.

    ``trigger`` is ``request`` for a request refused before it opened (a per-request
    attention backend override that breaks a rule, design §4.6): nothing moved then.

    Attributes:
        component: the component.
        trigger: the trigger refused.
        source: the state it stayed in.
        codes: every refusal's code.
        messages: every refusal's message, in the same order.
        hints: every refusal's fix, in the same order (none for a trigger not valid from
            ``source``, which has no refusal to name one).
        request_id: the request it happened for, or None.
        may_wait: refused while a stage tried to onload: the request may wait for
            memory and try again instead of being refused (``MemoryWait`` says how
            that ended).
    """

    component: str
    trigger: str
    source: str
    codes: tuple[str, ...]
    messages: tuple[str, ...]
    request_id: str | None
    hints: tuple[str, ...] = ()
    may_wait: bool = False


class MemoryWait(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="residency.waited"
):
    """A stage waited for other requests to release the device (``residency.waited``).

    Attributes:
        request_id: the request that waited.
        stage: the stage it waited to enter.
        components: the stage's components it waited to hold.
        seconds: how long it waited.
        outcome: ``acquired`` (the stage went on), ``refused`` (``memory.wait_timeout``
            passed first) or ``cancelled`` (the request was cancelled while it waited).
    """

    request_id: str
    stage: str
    components: tuple[str, ...]
    seconds: float
    outcome: Literal["acquired", "refused", "cancelled"]


class RequestBegan(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="request.begin"
):
    """A request opened (``request.begin``).

    Attributes:
        request_id: the request.
    """

    request_id: str


class PromptCounts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Rows of a request's batches whose text came from the prompt cache, and rows encoded.

    Attributes:
        hits: rows that took their text from the cache (their encoders not used).
        misses: rows the encode stage encoded (and the cache kept, where they fit).
    """

    hits: int = 0
    misses: int = 0


class RequestEnded(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="request.end",
    omit_defaults=True,
):
    """A request closed, its components put back (``request.end``).

    Attributes:
        request_id: the request.
        stages: the stages it entered, in order.
        duration_ms: how long it was open.
        cache: each component with a step cache: the image steps it computed and skipped
            for the request (design §17); empty, and left out of its JSON, where none ran.
        prompts: what the prompt cache answered for it (design §19); None, and left out
            of its JSON, where the pipeline has no prompt cache.
    """

    request_id: str
    stages: tuple[str, ...]
    duration_ms: float
    cache: dict[str, CacheSteps] = msgspec.field(default_factory=dict)
    prompts: PromptCounts | None = None

    @property
    def cache_skipped(self) -> int:
        """Return the image steps its step caches skipped, over every component."""
        return sum(steps.skipped for steps in self.cache.values())


class RequestCancelled(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="request.cancelled"
):
    """A request was cancelled; its work stopped there (``request.cancelled``).

    Attributes:
        request_id: the request cancelled (a worker's job: the job's id, also when it
            shared a batch with others that went on).
        stage: the stage it stopped in or was about to enter; None while it was queued.
        step: the denoising steps that stage had done.
    """

    request_id: str
    stage: str | None
    step: int


class PipelineTransitioned(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="pipeline.transition",
):
    """A pipeline went from one state to another (``pipeline.transition``): drain, release.

    Sleep and wake say it with an event of their own (``PipelineSlept``,
    ``PipelineWoke``), with the same fields.

    Attributes:
        pipeline: the pipeline.
        trigger: what moved it.
        source: the state it left (lower-case value).
        dest: the state it entered.
        duration_ms: how long the transition took, its components' moves included.
    """

    pipeline: str
    trigger: str
    source: str
    dest: str
    duration_ms: float


class PipelineSlept(
    PipelineTransitioned,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="pipeline.slept",
):
    """A pipeline went to sleep: its components left the device (``pipeline.slept``)."""


class PipelineWoke(
    PipelineTransitioned, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="pipeline.woke"
):
    """A pipeline woke: its components are back where ``load`` put them (``pipeline.woke``)."""


class PipelineSwapped(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="pipeline.swapped"
):
    """A worker replaced a pipeline by a new one of the same name (``pipeline.swapped``).

    Attributes:
        pipeline: the pipeline's name.
        path: the spec the new one was read from.
        overlapped: whether both were held at once (the budget held both, so the old
            one served until the new one was loaded); otherwise the old one was drained
            and released first.
        kept: the components the new one shares with the old, kept loaded across.
        duration_ms: how long the swap took.
    """

    pipeline: str
    path: str
    overlapped: bool
    kept: tuple[str, ...]
    duration_ms: float


class PipelineReloaded(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="pipeline.reloaded"
):
    """A worker re-read a pipeline's spec (``pipeline.reloaded``).

    Attributes:
        pipeline: the pipeline's name.
        path: the spec re-read.
        outcome: ``unchanged`` (nothing touched), ``swapped``, ``refused`` (check refused
            it: nothing changed) or ``restored`` (the new one failed to load; the old
            one serves again).
    """

    pipeline: str
    path: str
    outcome: ReloadOutcome


class PipelineRestored(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="pipeline.restored"
):
    """A swap's new pipeline failed to load; the old one was loaded again and serves
    (``pipeline.restored``).

    Attributes:
        pipeline: the pipeline's name.
        path: the spec of the new pipeline that failed.
        cause: why it failed.
    """

    pipeline: str
    path: str
    cause: str


class AdapterTransitioned(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="adapter.transition",
):
    """An adapter went from one state to another (``adapter.transition``, design §14).

    Attributes:
        adapter: the adapter.
        component: the component whose weights it changes.
        trigger: what moved it (``activate`` merges or attaches it).
        source: the state it left (lower-case value).
        dest: the state it entered.
        duration_ms: how long the transition took, guards and work together.
        request_id: the request it happened for, or None.
    """

    adapter: str
    component: str
    trigger: str
    source: str
    dest: str
    duration_ms: float
    request_id: str | None


class AdapterSwitched(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="adapter.switched"
):
    """A component's merged adapters changed for a request (``adapter.switched``).

    Attributes:
        component: the component whose weights changed.
        merged: each adapter merged into it now with its scale, by name (empty: the base).
        seconds: how long the switch took (unmerging what was merged, then merging).
        request_id: the request that needed it.
    """

    component: str
    merged: dict[str, float]
    seconds: float
    request_id: str | None


Event: TypeAlias = (
    Move
    | Transitioned
    | TriggerRefused
    | MemoryWait
    | RequestBegan
    | RequestEnded
    | RequestCancelled
    | PipelineTransitioned
    | PipelineSwapped
    | PipelineReloaded
    | PipelineRestored
    | AdapterTransitioned
    | AdapterSwitched
)
"""Everything an observer receives; ``msgspec.json.encode`` writes the log event's name
under ``type``."""

Observer: TypeAlias = Callable[[Event], None]
"""Called with every event of an orchestrator, on the thread that caused it, often with
the orchestrator's lock held: return quickly (hand slow work to a queue)."""


class Observers:
    """The observers attached to one orchestrator, or those of several joined.

    The emitting code tests ``attached`` before it builds an event, so that an
    orchestrator nobody observes pays one truth test per event. An observer that
    raises is logged and skipped: it never changes what the orchestrator does.

    A component several pipelines share reports to the observers of all of them:
    ``Observers.joining(parts)`` follows each part's observers as they are attached
    and detached, and holds each observer once (a worker's metrics observe every
    pipeline, and count a shared component's moves once).

    Attributes:
        attached: the observers, in the order they were attached.
    """

    __slots__ = ("_changing", "_followers", "_parts", "attached")

    def __init__(self) -> None:
        self.attached: tuple[Observer, ...] = ()
        self._changing = threading.Lock()
        self._parts: tuple[Observers, ...] = ()
        self._followers: list[Observers] = []

    @classmethod
    def joining(cls, parts: Sequence[Observers]) -> Observers:
        """Return the observers of every one of ``parts``, each once, kept up to date."""
        joined = cls()
        joined._parts = tuple(parts)
        for part in joined._parts:
            with part._changing:
                part._followers.append(joined)
        joined._follow()
        return joined

    def unjoin(self) -> None:
        """Stop following the parts (the joined set is replaced)."""
        for part in self._parts:
            with part._changing:
                part._followers.remove(self)
        self._parts = ()

    def attach(self, observer: Observer) -> Callable[[], None]:
        """Attach ``observer``; return the call that detaches it again."""
        with self._changing:  # a new tuple each time: emitting threads iterate without a lock
            self.attached = (*self.attached, observer)
            followers = list(self._followers)
        for follower in followers:
            follower._follow()
        detached = False

        def detach() -> None:
            nonlocal detached
            with self._changing:
                if not detached:
                    detached = True
                    index = self.attached.index(observer)
                    self.attached = self.attached[:index] + self.attached[index + 1 :]
                followers = list(self._followers)
            for follower in followers:
                follower._follow()

        return detach

    def _follow(self) -> None:
        """Take up the parts' observers again, each once."""
        self.attached = tuple(dict.fromkeys(o for part in self._parts for o in part.attached))

    def emit(self, event: Event) -> None:
        """Hand ``event`` to every attached observer."""
        for observer in self.attached:
            try:
                observer(event)
            except Exception as err:  # the observer's fault: the orchestrator goes on
                log.error(
                    "lifecycle.observer_failed",
                    observer=repr(observer),
                    event_type=type(event).__name__,
                    error=f"{type(err).__name__}: {err}",
                )


def __getattr__(name: str) -> object:
    """Return ``TriggerRefused`` under its deprecated name ``Refused``, with a warning."""
    if name == "Refused":
        warnings.warn(
            "lifecycle.events.Refused is deprecated: it is lifecycle.events.TriggerRefused "
            "(lifecycle.Refused is the exception)",
            DeprecationWarning,
            stacklevel=2,
        )
        return TriggerRefused
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
