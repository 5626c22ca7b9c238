"""The weight-store contract, its error, and the slots a store moves."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from components.accounting import inner_tensors, local_shard, module_bytes
from components.residency import OffloadTarget, OffloadVerify

__all__ = ["Group", "OffloadError", "Slot", "StoreOptions", "WeightStore"]


class OffloadError(RuntimeError):
    """A store could not build, move or read weights; the message says what, why and the fix."""


@dataclass(frozen=True, eq=False)
class Slot:
    """One tensor a store moves: a Parameter or buffer object and every name it has.

    Tied weights are one Parameter object registered under several names, so
    swapping that object's ``.data`` moves every name at once and keeps the tie.
    """

    names: tuple[str, ...]
    tensor: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def key(self) -> str:
        """The name the slot is stored under (its first name)."""
        return self.names[0]

    @property
    def nbytes(self) -> int:
        """The bytes the tensor takes when materialised."""
        return self.shape.numel() * self.dtype.itemsize


def collect_slots(module: nn.Module) -> list[Slot]:
    """Return one slot per distinct parameter or buffer of ``module``, ties folded together.

    Tensors that are views into a larger storage, or not contiguous, are
    compacted into storages of their own, so that accounting is exact and a
    tensor read back from a file has the layout it had here.

    Raises:
        OffloadError: a tensor is not materialised on the host CPU, or two distinct
            tensors share one storage (a tie a store could not keep); every
            offending tensor is named.
    """
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    named = chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    for name, held in named:
        # a quantized weight moves as its inner tensors (data, scales), each a slot
        for path, tensor in inner_tensors(held):
            names.setdefault(id(tensor), []).append(f"{name}.{path}" if path else name)
            tensors[id(tensor)] = tensor

    problems: list[str] = []
    storage_owner: dict[int, str] = {}
    for key, tensor in tensors.items():
        name = names[key][0]
        tensor = local_shard(tensor)
        if tensor.device.type != "cpu":
            problems.append(f"'{name}' is on {tensor.device}, not on the host CPU")
            continue
        if tensor.numel() == 0:
            continue
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in storage_owner:
            problems.append(
                f"'{name}' shares its storage with '{storage_owner[pointer]}' "
                "but is a different tensor"
            )
        storage_owner.setdefault(pointer, name)
    if problems:
        raise OffloadError(
            f"cannot keep the weights of {type(module).__name__} in a store: "
            + "; ".join(problems)
            + "; build the module on the host CPU with its weights loaded (as a loader "
            "returns it), and tie weights by assigning one nn.Parameter to both names"
        )

    slots: list[Slot] = []
    with torch.no_grad():
        for key, tensor in tensors.items():
            # a sharded weight stays resident (admission refuses to offload it): its
            # store accounts the local shard's bytes and never moves them
            local = local_shard(tensor)
            slot = Slot(tuple(names[key]), tensor, local.shape, local.dtype)
            if local is tensor and (
                not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != slot.nbytes
            ):
                tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
            slots.append(slot)
    return slots


class Group(Protocol):
    """Slots moved together: a whole component, its non-block part, or one block."""

    slots: list[Slot]
    nbytes: int
    is_resident: bool

    def prefetch(self) -> int:
        """Start bringing the slots to the device; return the bytes started (0 if none)."""
        ...

    def onload(self) -> int:
        """Make the slots usable on the device; return the bytes moved (0 if resident)."""
        ...

    def offload(self) -> int:
        """Take the slots off the device; return the bytes freed (0 if not resident)."""
        ...

    def discard(self) -> None:
        """Leave the device without persisting anything: the undo of a failed onload."""
        ...

    def held_bytes(self) -> int:
        """Return the device bytes the slots hold, a copy in flight included."""
        ...

    def close(self) -> None:
        """Drop the host copies; the slots are unusable afterwards unless resident."""
        ...


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """What a store may need besides its module; each store type reads its own part.

    Attributes:
        device: the compute device.
        file: returns the path of the store's safetensors file; called only by
            a store that writes one, so a host target never touches the disk.
        blocks: the module's block stack, or None when it has none.
        prefetch: blocks read ahead of the one that runs (layerwise).
        resident_layers: first blocks kept while resident (layerwise).
        runs: how many of the first blocks a forward runs (layerwise; None: all); the others
            are never fetched.
        verify: how a disk file is verified at onload.
    """

    device: torch.device
    file: Callable[[], Path]
    blocks: nn.ModuleList | None = None
    prefetch: int = 1
    resident_layers: int = 0
    runs: int | None = None
    verify: OffloadVerify = "checksum"


class WeightStore(ABC):
    """Where one module's weights live while the module is not on the compute device.

    A store takes a module that is fully built and materialised on the host CPU,
    as a loader returns it. Construction places it: by default the store starts
    **offloaded** (this is the module's first offload: a host store keeps its
    master copy, a disk store writes its file and frees the memory); with
    ``resident=True`` it starts **resident** on ``device`` instead. Parameter and
    buffer objects are never replaced, only their ``.data``, so
    ``module.parameters()`` keeps its identities and tied weights stay tied.

    Args:
        module: the component's module, on the host CPU.
        device: the compute device; ``cpu`` means the host is the device.

    Attributes:
        target: where the weights live while offloaded: ``host`` or ``disk``.
        module: the module whose weights move.
        device: the compute device.
        nbytes: the module's accounted bytes (parameters and buffers, ties once);
            what ``onload`` and ``offload`` move for the whole component.

    Raises:
        OffloadError: the module is not materialised on the host CPU, or holds
            two tensors sharing one storage.
    """

    target: OffloadTarget

    def __init__(self, module: nn.Module, device: torch.device | str) -> None:
        self.module = module
        self.device = torch.device(device)
        self._slots = collect_slots(module)
        self.nbytes = sum(slot.nbytes for slot in self._slots)
        self._is_closed = False

    @property
    @abstractmethod
    def is_resident(self) -> bool:
        """Whether the module's weights are usable on the compute device."""

    @classmethod
    @abstractmethod
    def from_options(
        cls, module: nn.Module, target: OffloadTarget, options: StoreOptions, *, resident: bool
    ) -> WeightStore:
        """Build a store of this type for ``module`` from what the factory was given."""

    @classmethod
    def footprint_of(cls, module: nn.Module, options: StoreOptions) -> int:
        """Return the most device bytes a store of this type would hold for ``module``.

        The default is every weight: the whole module is on the device while resident.
        """
        return module_bytes(module)

    @property
    def footprint(self) -> int:
        """Return the most device bytes this store holds while resident."""
        return self.nbytes

    def prefetch(self) -> int:
        """Start the onload early where the target allows; return the bytes to reserve.

        The default does nothing and returns 0: the target cannot start early.
        """
        self._check_open()
        return 0

    @abstractmethod
    def onload(self) -> int:
        """Make the module's weights usable on the compute device; return the bytes moved.

        Returns 0 when already resident. A failed onload leaves the module
        offloaded exactly as it was before re-raising.
        """

    @abstractmethod
    def offload(self) -> int:
        """Take the module's weights off the compute device; return the bytes freed.

        Returns 0 when already offloaded.
        """

    @abstractmethod
    def resident_bytes(self) -> int:
        """Return the bytes the module holds on the compute device, placeholders excluded."""

    def take_streamed(self) -> int:
        """Return the bytes of blocks streamed onto the device (and off) since the last call.

        Only a store that moves parts of the module while it runs streams any: 0 here.
        """
        return 0

    @abstractmethod
    def close(self) -> None:
        """Drop the store's files and host copies; the module must not be used afterwards."""

    def _check_open(self) -> None:
        if self._is_closed:
            raise OffloadError(
                f"the {type(self).__name__} of {type(self.module).__name__} is closed, "
                "so its weights can no longer move; build a new store for a loaded module"
            )
