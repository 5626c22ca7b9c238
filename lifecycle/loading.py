"""Loading: the work of ``load`` (build a component along its admitted plan) and its check.

The plan never changes after admission: a component is built through the path
admission chose, its attention layers take the planned backends from its scope,
and a path that turns out to be unavailable at load fails the transition (rolled
back) rather than re-planning the component.

Builds may run ahead, in parallel threads (``build_ahead``): a build reads the spec,
the admitted plan and the weight files, and touches no state the machine guards, so
it needs no lock. What it made becomes the component's only when that component's
``load`` transition runs, in order, under the machine's lock; a build that failed
fails that transition (the component stays ADMITTED), and whatever no transition took
is dropped (``discard_ahead``). Seen from outside, a parallel load is the sequential
one, sooner.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from torch import nn

from attention import Platform
from components import ResidencyMode
from components.compile import compile_module
from components.loader import LoaderPath, SeededOptions
from components.mesh import ParallelMesh
from components.quantize import quantize
from lifecycle.admission import ComponentAdmission
from lifecycle.admission.construction import construct_module
from lifecycle.device.moves import Residency
from lifecycle.device.slots import ComponentSlot
from lifecycle.distributed import setup_parallel
from lifecycle.machines.engine import TransitionContext
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["Loading"]


class Loading:
    """Build admitted components and check that what was built is what was planned.

    Args:
        spec: the pipeline spec (its parallel layout).
        slots: the orchestrator's components by name.
        platform: where the attention layers will run.
        residency: sizes a built component for the budget.
        threads: the most components built at once (None: one thread per component
            that may be, up to the CPU count; 1: one at a time, in order).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        slots: Mapping[str, ComponentSlot],
        platform: Platform,
        residency: Residency,
        threads: int | None = None,
    ) -> None:
        self.spec = spec
        self.threads = threads
        self.slots = slots
        self.platform = platform
        self.residency = residency
        self.mesh: ParallelMesh | None = None
        self._mesh_built = False
        self._ahead: dict[str, Future[nn.Module]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.build_ms: dict[str, float] = {}
        """How long each component's last build took, in milliseconds."""

    def parallel_builds(self, names: Sequence[str]) -> list[str]:
        """Return which of ``names`` may be built at once, ahead of their transitions.

        None with ``threads`` = 1, in a layout of several processes (ranks build in
        lockstep, their collectives in order), or when a component keeps the weights
        its builder drew from torch's global generator (neither a file nor a seed):
        threads would interleave those draws, and a load must give the same weights
        every time. Never a component offloaded to disk: the host memory check counts
        those one at a time, each freed once its file is written. Every other
        component stays in host memory once loaded (a master copy, or the weights
        themselves), so building them together holds no more than the loaded pipeline.
        Fewer than two is none: a thread would only add its start-up.
        """
        slots = [self.slots[name] for name in names]
        if self.threads == 1 or self.spec.parallel.world_size != 1:
            return []
        if not all(_weights_fixed(slot) for slot in slots):
            return []
        to_disk = self.spec.memory.offload_target == "disk"
        found = [s.name for s in slots if not (to_disk and s.mode is not ResidencyMode.RESIDENT)]
        return found if len(found) > 1 else []

    def build_ahead(self, names: Sequence[str]) -> None:
        """Start building ``names`` in parallel threads; their ``load`` transitions take them."""
        if not names:
            return
        threads = min(len(names), self.threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="load")
        self._ahead = {name: self._pool.submit(self._build, name) for name in names}

    def discard_ahead(self) -> None:
        """Drop the builds no transition took (a load failed first), once they end.

        Waiting for them, and for their threads, means that nothing still builds,
        holding memory, once ``Orchestrator.load()`` has returned or raised.
        """
        pool, self._pool, self._ahead = self._pool, None, {}
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # the threads too, not only the builds

    def load(self, name: str, context: TransitionContext) -> None:
        """Build ``name`` through its admitted path; undone by forgetting the module.

        The first load of the pipeline builds the layout's mesh (once, and after the
        ``world_launched`` guard passed); every later one shares it.
        """
        if not self._mesh_built:
            self.mesh = setup_parallel(self.spec, self.slots, self.residency.device)
            self._mesh_built = True
        slot = self.slots[name]
        ahead = self._ahead.pop(name, None)
        # a build that failed ahead raises here, inside the transition: it fails as inline
        slot.module = self._build(name) if ahead is None else ahead.result()
        context.on_rollback(slot.forget)
        # compiled lazily: inductor builds at the first forward of each shape class
        slot.compilation = compile_module(
            slot.module, slot.loader.compile, slot.loader.blocks(slot.module)
        )
        slot.footprint = self.residency.footprint(slot)  # may refuse what was built: undone

    def _build(self, name: str) -> nn.Module:
        """Build ``name`` through its admitted path, timed; nothing is assigned."""
        started = time.perf_counter()
        slot = self.slots[name]
        admitted = _admitted(slot)
        path: LoaderPath = "native" if admitted.plan.loader == "native" else "custom"
        module = construct_module(
            path,
            admitted.requests,
            admitted.planned,
            self.platform,
            partial(slot.loader.build, path),
        )
        # torchao replaces the linear weights once they hold the loaded values (design §17)
        quantize(module, slot.loader.quantization)
        self.build_ms[name] = round((time.perf_counter() - started) * 1e3, 3)
        return module

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


def _weights_fixed(slot: ComponentSlot) -> bool:
    """Tell whether ``slot``'s weights come from a file or a seed, not its builder's draws."""
    options = slot.loader.options
    return options.weights is not None or isinstance(options, SeededOptions)


def _admitted(slot: ComponentSlot) -> ComponentAdmission:
    if slot.admission is None:
        raise RuntimeError(f"component '{slot.name}' was never admitted; admit() it first")
    return slot.admission
