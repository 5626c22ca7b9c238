"""The disk-offload file: written once, read-only, verified when read, mapped or staged.

On a CPU device onload memory-maps the file (copy-on-write), so the weights
point into the page cache and nothing is copied (each tensor lies where its
resident weight lay relative to a 64-byte boundary, so a mapped weight computes
the bits the resident one did: :mod:`components.offload.aligned_file`);
elsewhere the slots' bytes are read, adjacent tensors in one read, into one
staging buffer (pinned on CUDA) and copied to the device. Either way the file
is the only copy of offloaded weights and onload reads it: a deleted,
truncated or changed file fails the onload and the module stays offloaded.

Why a mapped file cannot be truncated under running weights (which would kill
the process with SIGBUS on the next touch of a page past the new end): the
file lives in a folder only its owner may enter (0700) and is read-only (0400)
once written, so another user cannot open it for writing, and the store itself
never rewrites a file in place (a rewrite is a new file renamed over the old
name, so mapped pages keep the old inode alive). What remains is the owner, or
root, deliberately making it writable again; ``tests/components/test_disk_mapping.py``
shows that this does end the process with SIGBUS and that the stat check at the
next onload refuses such a file before mapping it.

Why ``checksum`` hashes a slot's bytes once per version of the file, not on
every read: the file's identity includes its ctime, which every write, chmod,
rename or truncate sets to the current time and which no call can set back.
So while the identity is the one a hash was checked under, the bytes are the
ones that were hashed. Timestamps tick coarsely (one kernel tick), so a change
made within a tick of the last one could keep the ctime: a hash is trusted only
when it started at least :data:`SETTLED_NS` after that ctime (git's "racily
clean" rule), and hashed again otherwise. Hashing on every read cost 99% of a
warm mapped onload (``benchmarks/disk_offload.py``). What a hash once per
version does not see is storage corrupting bytes under an unchanged inode
between two reads from disk.
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from components.offload.aligned_file import ALIGNMENT, residue, write_placed
from components.offload.base import OffloadError, Slot
from components.offload.removal import remove_path
from components.residency import OffloadVerify
from components.weights import digest

__all__ = ["DiskFile"]

_HEADER_LIMIT = 100 * 2**20
"""safetensors' own bound on the JSON header; anything larger is not such a file."""

_READ_ONLY = stat.S_IRUSR
"""A written offload file's mode: only its owner may read it, nobody may write it."""

SETTLED_NS = 100_000_000
"""How long after a file's last change (ctime) a hash must start to be trusted for its
identity: well above a kernel tick (1-10 ms), the granularity of file timestamps."""

Identity = tuple[int, int, int, int, int]
"""Device, inode, size, mtime and ctime (ns) of a file: any write, chmod or rename changes it."""


@dataclass(frozen=True)
class Written:
    """What a :class:`DiskFile` wrote: the file's identity, its layout and each slot's checksum.

    Attributes:
        identity: the file's identity as written.
        data_start: where the tensor data starts in the file.
        header: the safetensors header's entries by tensor name.
        checksums: each slot's xxh3 checksum by its key.
    """

    identity: Identity
    data_start: int
    header: dict[str, Any]
    checksums: dict[str, int]

    def span(self, slot: Slot) -> tuple[int, int]:
        """Return where ``slot``'s bytes start and end in the file."""
        begin, end = self.header[slot.key]["data_offsets"]
        return self.data_start + int(begin), self.data_start + int(end)


def identity(status: os.stat_result) -> Identity:
    """Return the parts of a file's status that change when it is replaced, written or chmodded."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def hash_is_trusted(status: os.stat_result, hash_started_ns: int) -> bool:
    """Return whether a hash that started at ``hash_started_ns`` vouches for ``status``'s identity.

    Only when the file had settled: a change after the hash started sets a later ctime.
    """
    return hash_started_ns - status.st_ctime_ns >= SETTLED_NS


class DiskFile:
    """The one safetensors file that holds every slot of a store, written once.

    Every parameter and buffer is stored, non-persistent buffers too: they are
    state the forward needs and no other copy is kept. Tied weights are one
    slot, stored once under their first name. What was written is kept
    (identity, layout, checksums; not the weights), so a read can tell the
    file was changed under it.

    Args:
        path: the file this store owns.
        slots: every slot of the store.
        verify: ``checksum`` compares each slot's checksum with the one taken
            at write time, once per identity of the file (see the module's
            docstring); ``stat`` refuses any change of the identity and
            never hashes.
    """

    def __init__(self, path: Path, slots: list[Slot], verify: OffloadVerify = "checksum") -> None:
        self.path = path
        self.verify = verify
        self._slots = slots
        self._written: Written | None = None
        self._hashed_under: dict[str, Identity] = {}
        self._reader: ThreadPoolExecutor | None = None

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
                    "again and nothing is offloaded; close the pipeline and load it afresh in a "
                    "new orchestrator, "
                    "and keep the offload directory out of reach of cleaners"
                )
        self._write()

    def will_hash(self, slots: list[Slot]) -> bool:
        """Return whether reading ``slots`` now would hash some of them (as far as known now)."""
        if self.verify != "checksum":
            return False
        try:
            now = identity(os.stat(self.path))
        except OSError:
            return False  # the read reports it
        return any(self._hashed_under.get(slot.key) != now for slot in slots)

    def read(self, slots: list[Slot], device: torch.device) -> list[torch.Tensor]:
        """Return ``slots`` read from the file as host tensors, in slot order, verified.

        On a CPU device they are views of a copy-on-write map of the file; on
        another device they are read into one staging buffer (pinned on CUDA)
        for the caller to copy.

        Raises:
            OffloadError: the file is missing, changed or truncated; nothing is swapped in.
        """
        if self._written is None:
            raise OffloadError(
                f"offload file {self.path} was never written, so there is nothing to onload; "
                "offload the module before onloading it"
            )
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError as err:
            raise OffloadError(
                f"offload file {self.path} is missing: it held the only copy of the offloaded "
                "weights, so they cannot be onloaded and the module stays offloaded; close "
                "the pipeline and load it afresh in a new orchestrator to rewrite the file, and "
                "keep the offload "
                "directory out of reach of cleaners"
            ) from err
        except OSError as err:
            raise self._unreadable(err) from err
        try:
            hash_started_ns = time.time_ns()
            status = self._check_identity(fd, slots, self._written)
            if device.type == "cpu":
                tensors = _map(fd, status.st_size, slots, self._written)
            else:
                tensors = self._stage(fd, slots, self._written, device)
        except OSError as err:
            raise self._unreadable(err) from err
        finally:
            os.close(fd)
        if self.verify == "checksum":
            self._check_data(slots, tensors, self._written, status, hash_started_ns)
        return tensors

    def advise(self, slots: list[Slot]) -> None:
        """Ask the kernel to start reading ``slots``' pages into the page cache, and return.

        A hint: a file that cannot be opened is left for the read to report.
        """
        if self._written is None:
            return
        spans = [self._written.span(slot) for slot in slots]
        first = min((begin for begin, _ in spans), default=0)
        last = max((end for _, end in spans), default=0)
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read_later(self, slots: list[Slot], device: torch.device) -> Future[list[torch.Tensor]]:
        """Start :meth:`read` on the file's reader thread, so it overlaps compute."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"read {self.path.name}")
        return self._reader.submit(self.read, slots, device)

    def remove(self) -> None:
        """Delete the file, or whatever took its place, then stop the reader thread.

        Its path is the store's own, so a directory found there is deleted too, and
        a file already gone is fine: a release or close never fails over what was
        done to the file (``components.offload.removal``).

        Raises:
            OSError: the path cannot be emptied (a read-only folder or file system);
                the reader is left as it was.
        """
        remove_path(self.path)
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    def _check_identity(self, fd: int, slots: list[Slot], written: Written) -> os.stat_result:
        """Return the file's status if it may hold ``slots`` as written; else refuse it.

        The same identity passes at once. Another one is diagnosed from the
        header and size; past those, ``checksum`` lets the data checks decide
        (the slots' bytes may be intact) and ``stat`` refuses.
        """
        status = os.fstat(fd)
        if identity(status) == written.identity:
            return status
        with io.FileIO(fd, "rb", closefd=False) as file:
            data_start, header = _read_header(file, self.path)
        changed = [slot.key for slot in slots if header.get(slot.key) != written.header[slot.key]]
        if changed or data_start != written.data_start:
            self._refuse_changed(f"{', '.join(changed[:3]) or 'its header'} differ")
        cut = next((slot.key for slot in slots if written.span(slot)[1] > status.st_size), None)
        if cut is not None:
            raise OffloadError(
                f"offload file {self.path} ends inside tensor '{cut}': it was truncated "
                "after it was written, so the module stays offloaded; close the "
                "pipeline and load it afresh in a new orchestrator to rewrite the file"
            )
        if self.verify == "stat":
            self._refuse_changed("its size, mtime, ctime or inode differ")
        return status

    def _check_data(
        self,
        slots: list[Slot],
        tensors: list[torch.Tensor],
        written: Written,
        status: os.stat_result,
        hash_started_ns: int,
    ) -> None:
        """Hash the slots not yet hashed under the file's identity; refuse any that differ."""
        now = identity(status)
        unhashed = [
            (slot, tensor)
            for slot, tensor in zip(slots, tensors, strict=True)
            if self._hashed_under.get(slot.key) != now
        ]
        changed = [
            slot.key for slot, tensor in unhashed if digest(tensor) != written.checksums[slot.key]
        ]
        if changed:
            self._refuse_changed(f"the data of {', '.join(changed[:3])} differ from its checksum")
        if hash_is_trusted(status, hash_started_ns):
            self._hashed_under.update((slot.key, now) for slot, _ in unhashed)

    def _refuse_changed(self, what: str) -> None:
        raise OffloadError(
            f"offload file {self.path} was changed after it was written ({what}), so it no "
            "longer holds these weights and the module stays offloaded; give every store its "
            "own file, then close the pipeline and load it afresh in a new orchestrator"
        )

    def _unreadable(self, err: OSError) -> OffloadError:
        return OffloadError(
            f"cannot read offload file {self.path}: {err}; the module stays offloaded; "
            "fix the file's permissions or storage and onload again"
        )

    def _stage(
        self, fd: int, slots: list[Slot], written: Written, device: torch.device
    ) -> list[torch.Tensor]:
        """Read the slots into one staging buffer, each run of adjacent tensors in one read.

        Tensors apart only by the padding that places the next one are adjacent: the
        padding is read with them.
        """
        runs: list[tuple[int, int, list[int]]] = []  # file start, file end, slot indices
        for index in sorted(range(len(slots)), key=lambda index: written.span(slots[index])):
            begin, end = written.span(slots[index])
            if runs and begin - runs[-1][1] < ALIGNMENT:
                runs[-1] = (runs[-1][0], end, [*runs[-1][2], index])
            else:
                runs.append((begin, end, [index]))
        staging = torch.empty(
            sum(end - begin for begin, end, _ in runs),
            dtype=torch.uint8,
            pin_memory=device.type == "cuda",
        )
        buffer = staging.numpy().data
        storage = staging.untyped_storage()
        tensors: dict[int, torch.Tensor] = {}
        placed = 0
        for begin, end, indices in runs:
            if not _pread_into(fd, buffer[placed : placed + end - begin], begin):
                raise OffloadError(
                    f"offload file {self.path} ends inside tensor '{slots[indices[-1]].key}': "
                    "it was truncated while it was read, so the module stays offloaded; "
                    "close the pipeline and load it afresh in a new orchestrator to rewrite the "
                    "file"
                )
            for index in indices:
                offset = placed + written.span(slots[index])[0] - begin
                tensors[index] = _tensor_at(storage, offset, slots[index])
            placed += end - begin
        return [tensors[index] for index in range(len(slots))]

    def _write(self) -> None:
        tensors = {slot.key: slot.tensor.detach().to("cpu").contiguous() for slot in self._slots}
        residues = {slot.key: residue(slot.tensor) for slot in self._slots}
        checksums = {key: digest(tensor) for key, tensor in tensors.items()}
        partial = self.path.with_name(self.path.name + ".partial")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_placed(tensors, residues, partial)
            partial.chmod(_READ_ONLY)
            # a reader never sees a half-written file under the final name, and a
            # rewrite never touches the inode that running weights may still map
            os.replace(partial, self.path)
            with open(self.path, "rb") as file:
                data_start, header = _read_header(file, self.path)
                status = os.fstat(file.fileno())
        except ValueError as err:  # a dtype the format has no name for; the message says what to do
            raise OffloadError(f"cannot write offload file {self.path}: {err}") from err
        except OSError as err:
            partial.unlink(missing_ok=True)
            nbytes = sum(slot.nbytes for slot in self._slots)
            raise OffloadError(
                f"cannot write offload file {self.path}: {err}; nothing was offloaded; make its "
                f"directory writable with at least {nbytes} bytes free, or choose another "
                "memory.offload_dir"
            ) from err
        self._written = Written(identity(status), data_start, header, checksums)
        self._hashed_under.clear()


def _map(fd: int, size: int, slots: list[Slot], written: Written) -> list[torch.Tensor]:
    """Return the slots as views of one copy-on-write map of the whole file."""
    mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    spans = [written.span(slot) for slot in slots]
    first = min((begin for begin, _ in spans), default=0) // mmap.PAGESIZE * mmap.PAGESIZE
    last = max((end for _, end in spans), default=0)
    if last > first:
        # start reading the slots' pages now, not one fault at a time during compute
        mapped.madvise(mmap.MADV_WILLNEED, first, last - first)
    storage = torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()
    return [_tensor_at(storage, begin, slot) for slot, (begin, _) in zip(slots, spans, strict=True)]


def _tensor_at(storage: torch.UntypedStorage, begin: int, slot: Slot) -> torch.Tensor:
    """Return ``slot``'s tensor over its own slice of ``storage`` from byte ``begin``.

    A slice of its own (not a view of the whole buffer) keeps accounting per
    tensor exact; the slice keeps the buffer alive.
    """
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    own: torch.UntypedStorage = storage[begin : begin + slot.nbytes]
    return torch.empty(0, dtype=torch.uint8).set_(own).view(slot.dtype).reshape(slot.shape)


def _pread_into(fd: int, buffer: memoryview, offset: int) -> bool:
    """Fill ``buffer`` from ``fd`` at ``offset``; return False when the file ends first."""
    filled = 0
    while filled < len(buffer):
        count = os.preadv(fd, [buffer[filled:]], offset + filled)
        if not count:
            return False
        filled += count
    return True


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
