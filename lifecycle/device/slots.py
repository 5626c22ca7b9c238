"""The record of one component while it lives, and of the pipelines that use it."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from torch import nn

from attention import Attention
from attention.layer import find_layers
from components import ResidencyMode
from components.compile import Compilation
from components.loader import ComponentLoader
from components.offload import WeightStore
from lifecycle.admission import ComponentAdmission
from lifecycle.events import Observers
from lifecycle.machines.component import ComponentLifecycle
from lifecycle.plan import ComponentPlan
from lifecycle.spec.structs import ComponentSpec

if TYPE_CHECKING:  # sharing reads slots: the identity's type is only named here
    from lifecycle.device.sharing import ComponentIdentity

__all__ = ["ComponentSlot"]


class ComponentSlot:
    """Everything held for one component, on the device of the pipelines that use it.

    Args:
        name: the component's name in the pipeline that declares it.
        spec: what that pipeline's spec says of it.
        lifecycle: its place on the lifecycle machine.
        home: the key of that pipeline on its ``SharedDevice``.

    Attributes:
        name: the component's name in its home pipeline (its events carry it).
        key: its key on the device, unique among every pipeline's components.
        home: the pipeline that declared it and built it.
        users: each pipeline using it (its key) with the name it has there: its home,
            and every pipeline that shares it (``lifecycle.device.sharing``).
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
        identity: what makes it itself, once loaded on a device pipelines share
            (``lifecycle.device.sharing``); None otherwise.
    """

    def __init__(
        self,
        name: str,
        spec: ComponentSpec,
        lifecycle: ComponentLifecycle,
        loader: ComponentLoader,
        home: str = "",
    ) -> None:
        self.name = name
        self.home = home
        self.key = f"{home}/{name}"
        self.users: dict[str, str] = {home: name}
        self.spec = spec
        self.mode: ResidencyMode = spec.residency_mode  # read on every move: resolved once
        self.lifecycle = lifecycle
        self.loader = loader
        self.admission: ComponentAdmission | None = None
        self._module: nn.Module | None = None
        self.layers: tuple[Attention, ...] = ()
        self.store: WeightStore | None = None
        self.compilation: Compilation | None = None
        """What torch.compile did for it (design §17); None when it is not compiled."""
        self.footprint = 0
        self.in_use_by: Counter[str] = Counter()
        self.reserved = False
        self._observers: dict[str, Observers] = {home: lifecycle.observers}
        self._joined: Observers | None = None
        self.identity: ComponentIdentity | None = None

    @property
    def nbytes(self) -> int:
        """Return the bytes of its weights: its store's once it has one, else its footprint."""
        return self.footprint if self.store is None else self.store.nbytes

    def join_observers(self, pipeline: str, observers: Observers) -> None:
        """Hand its transitions and moves to ``observers`` too (a pipeline sharing it)."""
        self._observers[pipeline] = observers
        self._rejoin()

    def leave_observers(self, pipeline: str) -> None:
        """Stop handing its events to the observers of ``pipeline`` (no longer a user)."""
        self._observers.pop(pipeline, None)
        self._rejoin()

    def _rejoin(self) -> None:
        """Point the lifecycle at its one user's observers, or at all of its users'."""
        if self._joined is not None:
            self._joined.unjoin()
            self._joined = None
        users = list(self._observers.values())
        if len(users) == 1:
            self.lifecycle.observers = users[0]
            return
        self._joined = self.lifecycle.observers = Observers.joining(users)

    def label(self, pipeline: str) -> str:
        """Return how a message about ``pipeline`` names it: its name there, else its key."""
        return self.users.get(pipeline) or self.key

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
    def is_sharded(self) -> bool:
        """Tell whether its weights are sharded across ranks: such a component never moves
        (evicting DTensor shards to disk or pinned memory is not built; admission refuses
        asking for it explicitly)."""
        parallel = self.loader.parallel
        return parallel is not None and parallel.shards_weights

    @property
    def may_be_evicted(self) -> bool:
        """Tell whether the budget may evict it: offloadable, or resident only by default."""
        return not self.spec.is_pinned and not self.is_sharded

    def forget(self) -> None:
        """Drop the module and its store (release, or a rolled-back load)."""
        if self.store is not None:
            self.store.close()
        self.module = None
        self.store = None
        self.compilation = None
        self.footprint = 0
