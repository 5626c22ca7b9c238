"""The orchestrator's record of one component while it lives."""

from __future__ import annotations

from collections import Counter

from torch import nn

from attention import Attention
from attention.layer import find_layers
from components import ResidencyMode
from components.loader import ComponentLoader
from components.offload import WeightStore
from lifecycle.admission import ComponentAdmission
from lifecycle.config import ComponentSpec
from lifecycle.machine import ComponentLifecycle
from lifecycle.plan import ComponentPlan


class ComponentSlot:
    """Everything the orchestrator holds for one component.

    Attributes:
        name: the component's name.
        spec: what the pipeline spec says of it.
        mode: its residency mode, ``resident`` when none was written.
        lifecycle: its place on the lifecycle machine.
        loader: its kind's loader, with validated options.
        admission: what admission found for it (None before admission).
        module: the built module, from LOADED until RELEASED.
        layers: the module's attention layers, found once whenever a module is
            set (a rebuilt module gets its own), so that a move arms them
            without walking the module.
        store: where its weights live off the device, once it first moved.
        footprint: the bytes it takes on the device while resident.
        in_use_by: the open requests using it now, with how many of their stages each.
        reserved: whether a prefetch started its onload and holds its footprint
            in the budget until the onload transition completes it.
    """

    def __init__(
        self,
        name: str,
        spec: ComponentSpec,
        lifecycle: ComponentLifecycle,
        loader: ComponentLoader,
    ) -> None:
        self.name = name
        self.spec = spec
        self.mode: ResidencyMode = spec.residency_mode  # read on every move: resolved once
        self.lifecycle = lifecycle
        self.loader = loader
        self.admission: ComponentAdmission | None = None
        self._module: nn.Module | None = None
        self.layers: tuple[Attention, ...] = ()
        self.store: WeightStore | None = None
        self.footprint = 0
        self.in_use_by: Counter[str] = Counter()
        self.reserved = False

    @property
    def plan(self) -> ComponentPlan | None:
        """Return what admission decided, None before admission."""
        return None if self.admission is None else self.admission.plan

    @property
    def module(self) -> nn.Module | None:
        """Return the built module, or None when not loaded."""
        return self._module

    @module.setter
    def module(self, module: nn.Module | None) -> None:
        self._module = module
        self.layers = () if module is None else find_layers(module)

    def loaded_module(self) -> nn.Module:
        """Return the built module.

        Raises:
            RuntimeError: the component is not loaded.
        """
        if self._module is None:
            raise RuntimeError(f"component '{self.name}' has no module: load() the pipeline first")
        return self._module

    @property
    def may_be_evicted(self) -> bool:
        """Tell whether the budget may evict it: offloadable, or resident only by default.

        A component whose weights are sharded stays: evicting DTensor shards to disk or
        pinned memory is not built (admission refuses asking for it explicitly).
        """
        parallel = self.loader.parallel
        return not self.spec.is_pinned and not (parallel is not None and parallel.shards_weights)

    def forget(self) -> None:
        """Drop the module and its store (release, or a rolled-back load)."""
        if self.store is not None:
            self.store.close()
        self.module = None
        self.store = None
        self.footprint = 0
