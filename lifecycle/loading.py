"""Loading: the work of ``load`` (build a component along its admitted plan) and its check.

The plan never changes after admission: a component is built through the path
admission chose, its attention layers take the planned backends from its scope,
and a path that turns out to be unavailable at load fails the transition (rolled
back) rather than re-planning the component.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from attention import Platform
from components.loader import LoaderPath
from components.mesh import ParallelMesh
from lifecycle.admission import ComponentAdmission
from lifecycle.admission.construction import construct_module
from lifecycle.config import PipelineSpec
from lifecycle.distributed import setup_parallel
from lifecycle.machine import TransitionContext
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.residency import Residency
from lifecycle.slots import ComponentSlot


class Loading:
    """Build admitted components and check that what was built is what was planned.

    Args:
        spec: the pipeline spec (its parallel layout).
        slots: the orchestrator's components by name.
        platform: where the attention layers will run.
        residency: sizes a built component for the budget.
    """

    def __init__(
        self,
        spec: PipelineSpec,
        slots: Mapping[str, ComponentSlot],
        platform: Platform,
        residency: Residency,
    ) -> None:
        self.spec = spec
        self.slots = slots
        self.platform = platform
        self.residency = residency
        self.mesh: ParallelMesh | None = None
        self._mesh_built = False

    def load(self, name: str, context: TransitionContext) -> None:
        """Build ``name`` through its admitted path; undone by forgetting the module.

        The first load of the pipeline builds the layout's mesh (once, and after the
        ``world_launched`` guard passed); every later one shares it.
        """
        if not self._mesh_built:
            self.mesh = setup_parallel(self.spec, self.slots, self.residency.device)
            self._mesh_built = True
        slot = self.slots[name]
        admitted = _admitted(slot)
        path: LoaderPath = "native" if admitted.plan.loader == "native" else "custom"
        slot.module = construct_module(
            path,
            admitted.requests,
            admitted.planned,
            self.platform,
            partial(slot.loader.build, path),
        )
        context.on_rollback(slot.forget)
        slot.footprint = self.residency.footprint(slot)  # may refuse what was built: undone

    def plan_honoured(self, name: str) -> list[Refusal]:
        """Refuse a build whose attention sites differ from the admitted plan.

        Each layer built in the scope already took its site's planned backend; this
        catches a declared site that was never built, and layers built outside the
        scope (a native path that constructs ``attention.Attention`` after all).
        """
        slot = self.slots[name]
        admitted = _admitted(slot)
        if admitted.plan.loader == "custom" and admitted.planned is None:
            return []  # a generic kind's sites are unknown: its scope enforced its requests
        # the slot found the module's layers once, when load set the module
        built = {layer.site: layer.backend_name for layer in slot.layers}
        expected = {site.site: site.backend for site in admitted.plan.attention}
        if built == expected:
            return []
        return [
            Refusal(
                code=RefusalCode.PLAN_DIVERGED,
                component=name,
                message=f"the {admitted.plan.loader} path of kind '{slot.spec.kind}' built "
                f"attention sites {built or 'none'}, but the admitted plan is "
                f"{expected or 'none'}",
                hint=f"make kind '{slot.spec.kind}' declare exactly the attention sites "
                "it builds on each path",
            )
        ]


def _admitted(slot: ComponentSlot) -> ComponentAdmission:
    if slot.admission is None:
        raise RuntimeError(f"component '{slot.name}' was never admitted; admit() it first")
    return slot.admission
