"""Disk offload: weights written once as safetensors, memory really freed, read back on onload."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from components.offload.base import OffloadError, Slot, WeightStore

_HEADER_LIMIT = 100 * 2**20
"""safetensors' own bound on the JSON header; anything larger is not such a file."""


class DiskFile:
    """The one safetensors file that holds every slot of a store, written once.

    Every parameter and buffer is stored, non-persistent buffers too: they are
    state the forward needs and no other copy is kept. Tied weights are one
    slot, stored once under their first name. The header as written is kept
    (not the weights), so a read can tell the file was changed under it.
    """

    def __init__(self, path: Path, slots: list[Slot]) -> None:
        self.path = path
        self._slots = slots
        self._written: tuple[int, dict[str, Any]] | None = None

    def ensure_written(self) -> None:
        """Write the file unless this store already wrote it and it is still there.

        Raises:
            OffloadError: the file cannot be written, or it vanished while some
                slots are placeholders, so it can no longer be written whole.
        """
        if self._written is not None and self.path.exists():
            return
        if self._written is not None:
            lost = [slot.key for slot in self._slots if slot.nbytes and slot.tensor.numel() == 0]
            if lost:
                raise OffloadError(
                    f"offload file {self.path} is missing while {len(lost)} tensors "
                    f"({', '.join(lost[:3])}, ...) exist only in it, so it cannot be written "
                    "again and nothing is offloaded; release the component and load it again, "
                    "and keep the offload directory out of reach of cleaners"
                )
        self._write()

    def read(self, slots: list[Slot], device: torch.device) -> list[torch.Tensor]:
        """Read ``slots`` from the file into new tensors on ``device``, in slot order.

        Each tensor is read straight into its own freshly allocated host memory
        (not memory-mapped), in file order, so the bytes are really read.

        Raises:
            OffloadError: the file is missing, changed or truncated; nothing is swapped in.
        """
        if self._written is None:
            raise OffloadError(
                f"offload file {self.path} was never written, so there is nothing to onload; "
                "offload the module before onloading it"
            )
        try:
            with open(self.path, "rb", buffering=0) as file:
                return self._read(file, slots, device, *self._written)
        except FileNotFoundError as err:
            raise OffloadError(
                f"offload file {self.path} is missing: it held the only copy of the offloaded "
                "weights, so they cannot be onloaded and the module stays offloaded; release "
                "the component and load it again to rewrite the file, and keep the offload "
                "directory out of reach of cleaners"
            ) from err
        except OSError as err:
            raise OffloadError(
                f"cannot read offload file {self.path}: {err}; the module stays offloaded; "
                "fix the file's permissions or storage and onload again"
            ) from err

    def _read(
        self,
        file: io.FileIO,
        slots: list[Slot],
        device: torch.device,
        written_start: int,
        written: dict[str, Any],
    ) -> list[torch.Tensor]:
        data_start, header = _read_header(file, self.path)
        changed = [slot.key for slot in slots if header.get(slot.key) != written[slot.key]]
        if changed or data_start != written_start:
            raise OffloadError(
                f"offload file {self.path} was changed after it was written "
                f"({', '.join(changed[:3]) or 'its header'} differ), so it no longer holds these "
                "weights and the module stays offloaded; give every store its own file, then "
                "release the component and load it again"
            )
        tensors: dict[str, torch.Tensor] = {}
        for slot in sorted(slots, key=lambda slot: int(header[slot.key]["data_offsets"][0])):
            begin, end = header[slot.key]["data_offsets"]
            file.seek(data_start + begin)
            raw = torch.empty(end - begin, dtype=torch.uint8)
            if not _read_into(file, raw.numpy().data):
                raise OffloadError(
                    f"offload file {self.path} ends inside tensor '{slot.key}': it was truncated "
                    "after it was written, so the module stays offloaded; release the "
                    "component and load it again to rewrite the file"
                )
            tensor = raw.view(slot.dtype).reshape(slot.shape)
            tensors[slot.key] = tensor if device.type == "cpu" else tensor.to(device)
        return [tensors[slot.key] for slot in slots]

    def _write(self) -> None:
        tensors = {slot.key: slot.tensor.detach().to("cpu").contiguous() for slot in self._slots}
        partial = self.path.with_name(self.path.name + ".partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(partial))
            # a reader never sees a half-written file under the final name
            os.replace(partial, self.path)
            with open(self.path, "rb") as file:
                data_start, header = _read_header(file, self.path)
        except (OSError, SafetensorError) as err:
            partial.unlink(missing_ok=True)
            nbytes = sum(slot.nbytes for slot in self._slots)
            raise OffloadError(
                f"cannot write offload file {self.path}: {err}; nothing was offloaded; make its "
                f"directory writable with at least {nbytes} bytes free, or choose another "
                "memory.offload_dir"
            ) from err
        self._written = (data_start, header)


def _read_header(file: BinaryIO, path: Path) -> tuple[int, dict[str, Any]]:
    """Return where the data starts and the header's entries of a safetensors file."""
    prefix = file.read(8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    try:
        if not 0 < length <= _HEADER_LIMIT:
            raise ValueError(f"header length {length}")
        header = json.loads(file.read(length))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as err:
        raise OffloadError(
            f"offload file {path} is not a safetensors file ({err}): it was overwritten after "
            "it was written, so the module stays offloaded; release the component and load "
            "it again to rewrite it"
        ) from err
    return 8 + length, header


def _read_into(file: io.FileIO, buffer: memoryview) -> bool:
    """Fill ``buffer`` from ``file``; return False when the file ends first."""
    filled = 0
    while filled < len(buffer):
        count = file.readinto(buffer[filled:])
        if not count:
            return False
        filled += count
    return True


class DiskGroup:
    """Slots offloaded to a :class:`DiskFile`: placeholders while out, read back on onload.

    A placeholder is a 0-element tensor of the slot's dtype on the compute
    device, so the memory is really freed while the Parameter object (and any
    tie through it) stays. Starts as loaded (materialised on the host), then
    moves to the device (``resident``) or offloads.
    """

    def __init__(
        self, slots: list[Slot], file: DiskFile, device: torch.device, *, resident: bool
    ) -> None:
        self.slots = slots
        self.nbytes = sum(slot.nbytes for slot in slots)
        self.is_resident = True
        self._file = file
        self._device = device
        if resident:
            self._swap_in([slot.tensor.data.to(device) for slot in slots])
        else:
            self.offload()

    def prefetch(self) -> int:
        """Read the slots now: a disk read has no copy stream to overlap on."""
        return self.onload()

    def onload(self) -> int:
        """Read the slots from the file onto the device; return the bytes read."""
        if self.is_resident:
            return 0
        self._swap_in(self._file.read(self.slots, self._device))
        return self.nbytes

    def offload(self) -> int:
        """Make sure the file holds the weights, then free them; return the bytes freed."""
        if not self.is_resident:
            return 0
        self._file.ensure_written()
        self.discard()
        return self.nbytes

    def discard(self) -> None:
        """Replace every slot's storage with a placeholder."""
        with torch.no_grad():
            for slot in self.slots:
                slot.tensor.data = torch.empty(0, dtype=slot.dtype, device=self._device)
        self.is_resident = False

    def held_bytes(self) -> int:
        """Return the slots' bytes while resident, else 0."""
        return self.nbytes if self.is_resident else 0

    def close(self) -> None:
        """Nothing to drop: the file belongs to the store."""

    def _swap_in(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for slot, tensor in zip(self.slots, tensors, strict=True):
                slot.tensor.data = tensor
        self.is_resident = True


class DiskStore(WeightStore):
    """Offload to a safetensors file: memory is really freed, onload reads the file back.

    The file at ``path`` is written at the first offload (at construction
    unless ``resident``) and reused after it; weights changed while resident
    are not written again. While offloaded every parameter and buffer is a
    0-element placeholder and the file is the only copy: deleting it makes the
    next onload fail and leaves the module offloaded.

    Args:
        module: the component's module, materialised on the host CPU.
        path: the safetensors file this store owns; ``close()`` deletes it.
        device: the compute device.
        resident: start resident on ``device`` (the file is written at the first offload).
    """

    target = "disk"

    def __init__(
        self,
        module: nn.Module,
        path: Path | str,
        device: torch.device | str,
        *,
        resident: bool = False,
    ) -> None:
        super().__init__(module, device)
        self.path = Path(path)
        file = DiskFile(self.path, self._slots)
        self._group = DiskGroup(self._slots, file, self.device, resident=resident)

    @property
    def is_resident(self) -> bool:
        """Whether the module's weights are usable on the compute device."""
        return self._group.is_resident

    def onload(self) -> int:
        """Read the file back into the module's own Parameter objects; return the bytes read.

        Raises:
            OffloadError: the file is missing, changed or truncated; the module
                stays offloaded.
        """
        self._check_open()
        return self._group.onload()

    def offload(self) -> int:
        """Write the file if needed, then free every tensor; return the bytes freed.

        Raises:
            OffloadError: the file cannot be written; nothing is freed.
        """
        self._check_open()
        return self._group.offload()

    def resident_bytes(self) -> int:
        """Return the module's accounted bytes while resident, else 0 (placeholders)."""
        return self.nbytes if self._group.is_resident else 0

    def close(self) -> None:
        """Delete the file; an offloaded module keeps its placeholders."""
        if not self._is_closed:
            self.path.unlink(missing_ok=True)
            self._is_closed = True
