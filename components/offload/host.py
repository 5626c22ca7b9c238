"""Host offload: a host master copy, so offload is a pointer swap."""

from __future__ import annotations

import torch
from torch import nn

from components.offload.base import Slot, StoreOptions
from components.offload.whole import WholeStore
from components.residency import OffloadTarget

__all__ = ["HostGroup", "HostStore", "copy_stream"]


class HostGroup:
    """Slots whose master copy lives in host memory (pinned when the device is CUDA).

    Offload points every slot back at its master: no device-to-host copy. On
    CUDA, onload allocates on the compute stream (the caller's current stream),
    copies on ``stream`` with ``non_blocking=True`` and records an event that
    the compute stream waits on before the tensors are swapped in. On a CPU
    device the master is the tensor itself and nothing moves: a move is a state
    flip (the accounting follows it) that touches no tensor.
    """

    def __init__(
        self, slots: list[Slot], device: torch.device, stream: torch.cuda.Stream | None
    ) -> None:
        self.slots = slots
        self.nbytes = sum(slot.nbytes for slot in slots)
        self.is_resident = False
        self._device = device
        self._stream = stream
        # on a CPU device every slot already points at its master: nothing to re-point
        self._moves = device.type != "cpu"
        with torch.no_grad():
            if device.type == "cuda":
                # pinned pages are what makes the host-to-device copy asynchronous
                self._masters = [slot.tensor.detach().pin_memory() for slot in slots]
                for slot, master in zip(slots, self._masters, strict=True):
                    slot.tensor.data = master
            else:
                self._masters = [slot.tensor.data for slot in slots]
        self._pending: list[torch.Tensor] | None = None
        self._event: torch.cuda.Event | None = None

    def prefetch(self) -> int:
        """Start the host-to-device copy; return the bytes started (0 if resident or started)."""
        if self.is_resident or self._pending is not None:
            return 0
        self._pending = self._start_copies()
        return self.nbytes

    def onload(self) -> int:
        """Complete a started copy (or do one now) and swap the device tensors in."""
        if self.is_resident:
            return 0
        if self._moves:
            copies = self._pending if self._pending is not None else self._start_copies()
            self._wait_for_copies()
            with torch.no_grad():
                for slot, copy in zip(self.slots, copies, strict=True):
                    slot.tensor.data = copy
        self._pending = None
        self.is_resident = True
        return self.nbytes

    def offload(self) -> int:
        """Point every slot back at its host master; return the bytes freed on the device."""
        if self._pending is not None:
            # memory a copy is still writing must not be handed out again before it ends
            self._wait_for_copies()
            self._pending = None
        if not self.is_resident:
            return 0
        self.discard()
        return self.nbytes

    def discard(self) -> None:
        """Point every slot back at its host master (the master is never stale)."""
        if self._moves:
            with torch.no_grad():
                for slot, master in zip(self.slots, self._masters, strict=True):
                    slot.tensor.data = master
        self.is_resident = False

    def held_bytes(self) -> int:
        """Return the device bytes held: resident, or allocated for a copy in flight."""
        return self.nbytes if self.is_resident or self._pending is not None else 0

    def close(self) -> None:
        """Wait for any copy in flight, then drop the references to the masters."""
        self._wait_for_copies()
        self._pending = None
        self._masters = []

    def _start_copies(self) -> list[torch.Tensor]:
        if self._device.type == "cpu":
            return list(self._masters)  # the host is the device: nothing to move
        if self._stream is None:
            return [master.to(self._device) for master in self._masters]
        compute = torch.cuda.current_stream(self._device)
        # the new tensors may reuse memory that work already queued on the compute
        # stream still reads, so the copies start only after that work
        self._stream.wait_stream(compute)
        copies = [torch.empty_like(master, device=self._device) for master in self._masters]
        with torch.cuda.stream(self._stream):
            for copy, master in zip(copies, self._masters, strict=True):
                copy.copy_(master, non_blocking=True)
            self._event = self._stream.record_event()
        return copies

    def _wait_for_copies(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None


def copy_stream(device: torch.device) -> torch.cuda.Stream | None:
    """Return a dedicated copy stream on a CUDA device; None elsewhere (copies are synchronous)."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated


class HostStore(WholeStore):
    """Offload to host memory: a host master copy makes offload a pointer swap.

    On CUDA the master copy is pinned; ``prefetch()`` starts the onload early
    on a dedicated copy stream and ``onload()`` completes it (the compute stream
    waits on the copy's event). The compute stream is the current stream of the
    thread that calls ``onload()``; run the module on it. On a CPU device the
    host is the device: nothing moves, ``onload``/``offload`` return the
    accounted bytes, and ``resident_bytes()`` follows the state.

    Args:
        module: the component's module, materialised on the host CPU.
        device: the compute device.
        resident: start resident on ``device`` instead of offloaded.
    """

    target = "host"

    def __init__(
        self, module: nn.Module, device: torch.device | str, *, resident: bool = False
    ) -> None:
        super().__init__(module, device)
        self._group = HostGroup(self._slots, self.device, copy_stream(self.device))
        if resident:
            self._group.onload()

    @classmethod
    def from_options(
        cls, module: nn.Module, target: OffloadTarget, options: StoreOptions, *, resident: bool
    ) -> HostStore:
        """Build a host store on ``options.device``."""
        return cls(module, options.device, resident=resident)
