"""The per-request attention backend override (design §4.6): validate, then prepare.

A request may name ``attention_backend``. It applies to the switchable sites: those
of kinds that declare ``switchable_backends`` (the denoiser) whose backend the spec
did not set explicitly. ``override_refusals`` is the pure decision (every reason the
request is refused, or none); ``BackendSwitch`` carries an accepted target out,
preparing one impl per switchable layer once per target, and only after every impl
was built, so that a failed prepare switches nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from msgspec import structs

from attention import (
    Attention,
    BackendChoice,
    BackendRequest,
    BackendSelectionError,
    PlannedSelection,
    Platform,
    Provenance,
    select_backend,
)
from attention import registry as backends
from attention.backend import AttentionImpl
from components.loader import ComponentLoader
from lifecycle.admission import ComponentAdmission
from lifecycle.device.slots import ComponentSlot
from lifecycle.logs import get_logger
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.refusals import RequestRefused as RequestRefused  # its first home: re-exported
from lifecycle.shown import shown

__all__ = ["BackendSwitch"]

log = get_logger("lifecycle")

REQUEST = "<request>"
"""The component name of a refusal that is about the request, not one component."""

SiteMap = Mapping[str, Mapping[str, PlannedSelection]]
"""Component -> switchable site -> what admission planned for it."""


def switchable_sites(
    loader: ComponentLoader, admission: ComponentAdmission | None
) -> dict[str, PlannedSelection]:
    """Return the sites of one component a request may switch: kind switchable, not explicit."""
    if not loader.switchable_backends or admission is None or admission.planned is None:
        return {}
    return {
        site: planned
        for site, planned in admission.planned.items()
        if planned.selection.provenance is not Provenance.EXPLICIT
    }


def override_refusals(target: str, sites: SiteMap, platform: Platform) -> list[Refusal]:
    """Return every reason a request naming ``target`` is refused; empty when it may run.

    Refused: an unknown name; a sparse target, or a switchable site whose planned
    backend is sparse; no switchable site; a site that cannot run the target
    (capability, supported set, ring needs the LSE, platform). The target is
    asked for explicitly, so it is never resolved to another backend.
    """
    known = backends.names()
    if target not in known:
        return [
            _invalid(
                f"attention_backend {shown(target)} is not a known backend",
                f"name one of: {', '.join(known)}, or leave attention_backend out",
            )
        ]
    runnable = ", ".join(_runnable(sites, platform)) or "none"
    hint = f"name a backend every switchable site runs ({runnable}), or leave it out"
    refusals: list[Refusal] = []
    if backends.get(target).is_sparse:
        refusals.append(
            _invalid(
                f"attention_backend '{target}' is sparse (an approximation); a request "
                "may not switch the denoiser to it",
                hint,
            )
        )
    for component, found in sites.items():
        for site, planned in found.items():
            if backends.get(planned.selection.backend).is_sparse:
                refusals.append(
                    _invalid(
                        f"site '{site}' of component '{component}' runs the sparse "
                        f"backend '{planned.selection.backend}' by default; a request may "
                        "not switch it to dense attention",
                        f"set components.{component}.attention_backend explicitly, or "
                        "leave attention_backend out",
                        component,
                    )
                )
    if not any(sites.values()):
        refusals.append(
            _invalid(
                "the pipeline has no switchable attention site (no component of a "
                "switchable kind whose backend the spec left unset)",
                "leave attention_backend out: the spec's explicit choices are authoritative",
            )
        )
    if refusals:
        return refusals
    for component, found in sites.items():
        for site, planned in found.items():
            refusals.extend(_site_refusals(target, component, site, planned, platform, hint))
    return refusals


def _site_refusals(
    target: str,
    component: str,
    site: str,
    planned: PlannedSelection,
    platform: Platform,
    hint: str,
) -> list[Refusal]:
    # an explicit choice is strict: select_backend tries the target alone and raises
    # rather than fall back (sparse targets, the one exception, were refused above)
    try:
        select_backend(_forced(planned, target), platform)
    except BackendSelectionError as err:
        return [
            Refusal(
                code=RefusalCode[err.code.name],
                component=component,
                message=err.message,
                hint=hint,
            )
        ]
    return []


def _forced(planned: PlannedSelection, target: str) -> BackendRequest:
    """Return the site's request with ``target`` as its only, explicit (strict) choice."""
    return structs.replace(
        planned.request,
        layer_backend=None,
        role_override=None,
        component_override=BackendChoice(name=target, provenance=Provenance.EXPLICIT),
        global_backend=None,
    )


def _runnable(sites: SiteMap, platform: Platform) -> list[str]:
    """Return the dense backends every switchable site could be switched to."""
    return [
        name
        for name in backends.names()
        if not backends.get(name).is_sparse
        and any(sites.values())
        and all(
            not _site_refusals(name, component, site, planned, platform, "")
            for component, found in sites.items()
            for site, planned in found.items()
        )
    ]


def _invalid(message: str, hint: str, component: str = REQUEST) -> Refusal:
    return Refusal(
        code=RefusalCode.INVALID_OVERRIDE, component=component, message=message, hint=hint
    )


class BackendSwitch:
    """Validate and prepare per-request overrides for one orchestrator's components.

    Decisions are cached per target: a refused target stays refused, a prepared one
    stays prepared (both are functions of the admitted plan and the platform).

    Args:
        slots: the orchestrator's components by name.
        platform: where they run.
    """

    def __init__(self, slots: Mapping[str, ComponentSlot], platform: Platform) -> None:
        self.slots = slots
        self.platform = platform
        self._lock = threading.Lock()
        self._refused: dict[str, tuple[Refusal, ...]] = {}
        self._prepared: set[str] = set()

    def prepare(self, target: str) -> None:
        """Make every switchable layer ready to run ``target`` for the requests that name it.

        Raises:
            RequestRefused: the override breaks a rule of design §4.6; nothing switched.
            RuntimeError: the pipeline is not loaded.
            Exception: building a kernel failed; nothing switched.
        """
        if target in self._prepared:
            return
        with self._lock:
            if target in self._prepared:
                return
            sites = {
                name: switchable_sites(slot.loader, slot.admission)
                for name, slot in self.slots.items()
            }
            if target not in self._refused:
                self._refused[target] = tuple(override_refusals(target, sites, self.platform))
            if self._refused[target]:
                raise RequestRefused(self._refused[target])
            prepared = [
                (layer, self._make_impl(name, target))
                for name, found in sites.items()
                for layer in self._layers(name)
                if layer.site in found
            ]
            for layer, impl in prepared:
                layer.make_switchable()
                layer.add_prepared(target, impl)
            self._prepared.add(target)
            log.info("attention.override_prepared", backend=target, layers=len(prepared))

    def _layers(self, name: str) -> list[Attention]:
        module = self.slots[name].module
        if module is None:
            raise RuntimeError(f"component '{name}' is not loaded: load() the pipeline first")
        return [m for m in module.modules() if isinstance(m, Attention)]

    def _make_impl(self, name: str, target: str) -> AttentionImpl:
        admission = self.slots[name].admission
        options = None if admission is None else admission.requests.backend_options.get(target)
        return backends.get(target).make_impl(options)
