"""Disk offload: memory really freed, the weights read back from their file on onload.

The file itself (writing, verification, mapping, staged reads, and why a
mapped file is not truncated under running weights) is
:mod:`components.offload.disk_file`.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from components.offload.base import Slot, StoreOptions
from components.offload.disk_file import DiskFile
from components.offload.whole import WholeStore
from components.residency import OffloadTarget, OffloadVerify

__all__ = ["DiskGroup", "DiskStore"]


class DiskGroup:
    """Slots offloaded to a :class:`DiskFile`: placeholders while out, read back on onload.

    A placeholder is a 0-element tensor of the slot's dtype on the compute
    device, so the memory is really freed while the Parameter object (and any
    tie through it) stays. Starts as loaded (materialised on the host), then
    moves to the device (``resident``) or offloads. ``prefetch`` starts the
    read early; ``onload`` completes it.
    """

    def __init__(
        self, slots: list[Slot], file: DiskFile, device: torch.device, *, resident: bool
    ) -> None:
        self.slots = slots
        self.nbytes = sum(slot.nbytes for slot in slots)
        self.is_resident = True
        self._file = file
        self._device = device
        self._pending: Future[list[torch.Tensor]] | None = None
        if resident:
            self._swap_in([slot.tensor.data.to(device) for slot in slots])
        else:
            self.offload()

    def prefetch(self) -> int:
        """Start bringing the slots in; return the device bytes it will hold (0 if none).

        On a CPU device the map costs next to nothing and a reader thread only
        competes with compute for the cores, so nothing is held and 0 is
        returned; when the onload will hash slots (``checksum``, a version of
        the file not hashed yet) the kernel is asked to read the pages ahead,
        which pays with a cold page cache (the onload then hashes pages already
        read), while before a read that only maps it made cold forwards slower
        (``benchmarks/disk_offload.py``), so nothing is done. Elsewhere the
        slots are read into staging memory on the file's reader thread, and
        ``onload`` copies them.
        """
        if self.is_resident or self._pending is not None:
            return 0
        if self._device.type == "cpu":
            if self._file.will_hash(self.slots):
                self._file.advise(self.slots)
            return 0
        self._pending = self._file.read_later(self.slots, self._device)
        return self.nbytes

    def onload(self) -> int:
        """Complete a started read (or read now) and swap the slots in; return the bytes read.

        Raises:
            OffloadError: the file is missing, changed or truncated; the slots stay out.
        """
        if self.is_resident:
            return 0
        pending, self._pending = self._pending, None
        tensors = self._file.read(self.slots, self._device) if pending is None else pending.result()
        if self._device.type != "cpu":
            tensors = [tensor.to(self._device) for tensor in tensors]
        self._swap_in(tensors)
        return self.nbytes

    def offload(self) -> int:
        """Make sure the file holds the weights, then free them; return the bytes freed."""
        self._drop_pending()
        if not self.is_resident:
            return 0
        self._file.ensure_written()
        self.discard()
        return self.nbytes

    def discard(self) -> None:
        """Replace every slot's storage with a placeholder."""
        self._drop_pending()
        with torch.no_grad():
            for slot in self.slots:
                slot.tensor.data = torch.empty(0, dtype=slot.dtype, device=self._device)
        self.is_resident = False

    def held_bytes(self) -> int:
        """Return the slots' bytes while resident or being read, else 0."""
        return self.nbytes if self.is_resident or self._pending is not None else 0

    def close(self) -> None:
        """Wait for a read in flight; the file belongs to the store."""
        self._drop_pending()

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()  # wait for it: its failure does not matter once dropped

    def _swap_in(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for slot, tensor in zip(self.slots, tensors, strict=True):
                slot.tensor.data = tensor
        self.is_resident = True


class DiskStore(WholeStore):
    """Offload to a safetensors file: memory is really freed, onload reads the file back.

    The file at ``path`` is written at the first offload (at construction
    unless ``resident``), made read-only, and reused after it; weights changed
    while resident are not written again. While offloaded every parameter and
    buffer is a 0-element placeholder and the file is the only copy: deleting
    or changing it makes the next onload fail and leaves the module offloaded.

    Args:
        module: the component's module, materialised on the host CPU.
        path: the safetensors file this store owns; ``close()`` deletes it.
        device: the compute device.
        resident: start resident on ``device`` (the file is written at the first offload).
        verify: how onloads verify the file (see :class:`DiskFile`).
    """

    target = "disk"

    def __init__(
        self,
        module: nn.Module,
        path: Path | str,
        device: torch.device | str,
        *,
        resident: bool = False,
        verify: OffloadVerify = "checksum",
    ) -> None:
        super().__init__(module, device)
        self.path = Path(path)
        self._file = DiskFile(self.path, self._slots, verify)
        self._group = DiskGroup(self._slots, self._file, self.device, resident=resident)

    @classmethod
    def from_options(
        cls, module: nn.Module, target: OffloadTarget, options: StoreOptions, *, resident: bool
    ) -> DiskStore:
        """Build a disk store whose file is ``options.file()``."""
        return cls(module, options.file(), options.device, resident=resident, verify=options.verify)

    def close(self) -> None:
        """Delete the file; an offloaded module keeps its placeholders.

        Raises:
            OSError: the file cannot be deleted; the store stays open.
        """
        if not self._is_closed:
            self._file.remove()
        super().close()
