"""What admission decides for a pipeline, as data that encodes to JSON."""

from __future__ import annotations

import msgspec

from attention import AttentionRole, Provenance
from components import ResidencyMode
from components.cache import CacheSettings
from components.compile import CompileMode
from components.dtypes import DType
from components.loader import LoaderPath
from components.quantize import Quantization
from lifecycle.machines.tables import AdapterState, ComponentState
from lifecycle.refusals import RefusalCode
from lifecycle.spec.structs import AdapterMode

__all__ = [
    "AdapterView",
    "AdmissionPlan",
    "ComponentPlan",
    "ComponentSnapshot",
    "LoadReport",
    "PipelineSnapshot",
    "RefusalReport",
    "SitePlan",
]


class SitePlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The backend admitted for one attention site, and why.

    Attributes:
        site: the site's name.
        role: what its layers attend to.
        backend: the backend its layers will run.
        provenance: where the request came from (explicit, automatic, default).
        reason: None when the requested backend was chosen, else the fallback reason.
    """

    site: str
    role: AttentionRole
    backend: str
    provenance: Provenance
    reason: str | None


class ComponentPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one component will be loaded and kept.

    Attributes:
        kind: the kind that builds it.
        loader: the loading path, or None when no path is admissible.
        residency: how it is kept on the device.
        attention: the plan of each declared attention site (none for a native
            path; unknown sites of a generic kind are chosen at load).
        dtype: the dtype of its floating weights.
        bytes: the bytes its weights take once loaded, declared by its kind or read from
            its weights' headers; None when unknown before it is built.
    """

    kind: str
    loader: LoaderPath | None
    residency: ResidencyMode
    attention: tuple[SitePlan, ...] = ()
    dtype: DType = "float32"
    bytes: int | None = None


class ComponentSnapshot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One component's plan and current state (design §10's snapshot entry).

    Attributes:
        kind: the kind that builds it.
        state: where it stands in the lifecycle.
        loader: the loading path, or None when none is admissible.
        residency: how it is kept on the device.
        attention: the backend of each attention site.
        dtype: the dtype of its floating weights.
        bytes: the bytes its weights take once loaded, known before loading (admission
            reads them from the kind or the weights' headers); None before admission or
            when unknown.
        users: the pipelines (their keys on the device) that hold it: more than one
            when it is shared (design §13).
        cache: its step cache with every default written out (design §17); None: none.
        compile: how torch.compile compiles it (design §17).
        quantization: how torchao holds its linear weights (design §17); ``bytes`` counts
            them quantized (data and scales).
    """

    kind: str
    state: ComponentState
    loader: LoaderPath | None
    residency: ResidencyMode
    attention: tuple[SitePlan, ...]
    dtype: DType = "float32"
    bytes: int | None = None
    users: tuple[str, ...] = ()
    cache: CacheSettings | None = None
    compile: CompileMode = "off"
    quantization: Quantization = "off"


class RefusalReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A refusal with the trigger it refused, as reported to ops and the CLI."""

    component: str
    trigger: str
    code: RefusalCode
    message: str
    hint: str


class AdapterView(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A read-only look at one adapter (``GET /v1/adapters`` and ``check`` list these).

    Attributes:
        name: the adapter.
        component: the component it changes ("" when admission could not tell).
        state: where it stands.
        mode: ``merged`` or ``unmerged``.
        scale: the scale a request runs it at when it gives none.
        path: its file (a spec's: absolute, read relative to the spec file).
        merged_scale: the scale it is merged at now (merged and active), else None.
        switches: how many switches of its component's merged set merged it in, took it
            out or changed its scale (an unmerged adapter never switches).
    """

    name: str
    component: str
    state: AdapterState
    mode: AdapterMode
    scale: float
    path: str
    merged_scale: float | None = None
    switches: int = 0


class PipelineSnapshot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every component's state and plan, for health endpoints and ``lifecycle check``.

    Attributes:
        pipeline: the pipeline's name.
        admitted: whether admission passed.
        components: each component's snapshot.
        refusals: every reason admission was refused (empty when admitted).
        stages: each stage's components, in timeline order.
        source: the folder the pipeline comes from, if any, or the model id it was read
            from, pinned at its commit (``ORG/NAME@COMMIT``).
        revision: the commit of a model id's source (the revision it resolved to in the
            Hugging Face cache); None for a folder's path.
        adapters: each adapter (LoRA), by name.
    """

    pipeline: str
    admitted: bool
    components: dict[str, ComponentSnapshot]
    refusals: tuple[RefusalReport, ...] = ()
    stages: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    source: str | None = None
    revision: str | None = None
    adapters: tuple[AdapterView, ...] = ()


class AdmissionPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The admitted plan of a whole pipeline.

    Attributes:
        pipeline: the pipeline's name.
        platform: the device kind it was planned for.
        components: each component's plan.
    """

    pipeline: str
    platform: str
    components: dict[str, ComponentPlan]


class LoadReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How long ``Orchestrator.load()`` took, whole and per component.

    Attributes:
        duration_ms: the whole load, wall time.
        components: for each component this load loaded, the milliseconds spent
            building it (its weights read or drawn) and putting it in its initial
            place; builds that ran in parallel overlap, so these may add up to more
            than ``duration_ms``.
        parallel: the components built in parallel threads (in spec order).
    """

    duration_ms: float
    components: dict[str, float]
    parallel: tuple[str, ...] = ()
