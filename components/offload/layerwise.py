"""Layerwise offload: blocks stream in just before they run and leave right after."""

from __future__ import annotations

import threading
from collections import Counter
from functools import partial
from itertools import chain
from pathlib import Path

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from components.offload.base import Group, OffloadError, Slot, StoreOptions, WeightStore
from components.offload.disk import DiskGroup
from components.offload.disk_file import DiskFile
from components.offload.host import HostGroup, copy_stream
from components.offload.layerwise_limits import layerwise_problems
from components.residency import OffloadTarget, OffloadVerify

__all__ = ["LayerwiseStore"]


class LayerwiseStore(WeightStore):
    """Offload a component block by block: only the blocks about to run are on the device.

    While the component is resident its non-block weights (and the first
    ``resident_layers`` blocks) are on the device; every other block of
    ``blocks`` is onloaded by a forward pre-hook just before it runs, along with
    the next ``prefetch`` blocks, and offloaded by a forward hook right after.
    When the forward of ``module`` ends, any block prefetched but not run is
    offloaded too. While the component is offloaded everything is out. So
    during a forward the resident bytes stay within non-block bytes +
    (``resident_layers`` + ``prefetch`` + 1) x the largest block.

    A weight used both inside a block and elsewhere (or by two blocks) counts
    as non-block. With target ``host`` on CUDA a prefetch is an asynchronous
    copy on the store's copy stream; on a CPU device with ``host`` nothing
    moves. With ``disk`` on CUDA a prefetch reads (and verifies) the block
    into pinned memory on the file's reader thread while the running block
    computes; on a CPU device, where onload only maps the file, it asks the
    kernel to read the block's pages ahead when the read will hash them and
    does nothing otherwise (see ``DiskGroup.prefetch`` for the measurements
    behind both). ``prefetch()`` of the whole component is not
    supported (it returns 0): its onload is the small non-block part. Run one
    forward of ``module`` at a time.

    Args:
        module: the component's module, materialised on the host CPU.
        blocks: the blocks that stream, in the order they run: submodules of ``module``
            (a ``ModuleList`` of it, or the blocks of several gathered in one list).
        target: where blocks and offloaded weights live: ``host`` or ``disk``.
        path: the safetensors file of target ``disk`` (written at construction,
            deleted by ``close()``); must be None for ``host``.
        device: the compute device.
        prefetch: how many blocks ahead of the running one to onload.
        resident_layers: how many of the first blocks stay while the component is resident.
        runs: how many of the first blocks a forward runs (None: all); no block past them is
            prefetched (a language model whose pipeline reads an intermediate layer).
        resident: start resident on ``device`` instead of offloaded.
        verify: how block reads verify the file of target ``disk``.

    Attributes:
        peak_bytes: the most bytes resident during the last forward of ``module``.

    ``take_streamed`` counts the block bytes that streamed through the device.

    Raises:
        OffloadError: an argument is out of range or ``blocks`` is not part of
            ``module`` (every problem named), or the store cannot be built.
    """

    def __init__(
        self,
        module: nn.Module,
        blocks: nn.ModuleList,
        *,
        target: OffloadTarget,
        device: torch.device | str,
        path: Path | str | None = None,
        prefetch: int = 1,
        resident_layers: int = 0,
        runs: int | None = None,
        resident: bool = False,
        verify: OffloadVerify = "checksum",
    ) -> None:
        _check_arguments(module, blocks, target, path, prefetch, resident_layers)
        super().__init__(module, device)
        self.target = target
        self.path = None if path is None else Path(path)
        self.prefetch_blocks = prefetch
        self.resident_layers = resident_layers
        self._runs = len(blocks) if runs is None else runs
        self._file = None if self.path is None else DiskFile(self.path, self._slots, verify)
        if self._file is not None:
            # streaming blocks are out even while the component is resident
            self._file.ensure_written()
        self._stream = copy_stream(self.device) if target == "host" else None
        rest, per_block = _partition(self._slots, blocks)
        self._rest = self._group(rest, resident=resident)
        self._blocks = [
            self._group(slots, resident=resident and index < resident_layers)
            for index, slots in enumerate(per_block)
        ]
        self._is_resident = resident
        self._running = threading.Lock()
        self._runner: int | None = None
        self._hooks: list[RemovableHandle] = [
            module.register_forward_pre_hook(self._before_forward),
            module.register_forward_hook(self._after_forward, always_call=True),
        ]
        for index, block in enumerate(blocks):
            self._hooks.append(block.register_forward_pre_hook(partial(self._before_block, index)))
            self._hooks.append(block.register_forward_hook(partial(self._after_block, index)))
        self.peak_bytes = self.resident_bytes()
        self._streamed = 0

    @classmethod
    def from_options(
        cls, module: nn.Module, target: OffloadTarget, options: StoreOptions, *, resident: bool
    ) -> LayerwiseStore:
        """Build a layerwise store over ``options.blocks`` (a file only for target ``disk``)."""
        if options.blocks is None:
            raise OffloadError(
                f"cannot build a LayerwiseStore for {type(module).__name__}: it has no block "
                "stack; use component_offload"
            )
        return cls(
            module,
            options.blocks,
            target=target,
            device=options.device,
            path=options.file() if target == "disk" else None,
            prefetch=options.prefetch,
            resident_layers=options.resident_layers,
            runs=options.runs,
            resident=resident,
            verify=options.verify,
        )

    @classmethod
    def footprint_of(cls, module: nn.Module, options: StoreOptions) -> int:
        """Return the non-block bytes + (``resident_layers + prefetch + 1``) x the largest block."""
        blocks = options.blocks
        if blocks is None:
            return super().footprint_of(module, options)
        named: dict[int, Slot] = {}
        for name, tensor in chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        ):
            known = named.get(id(tensor))
            names = (name,) if known is None else (*known.names, name)
            named[id(tensor)] = Slot(names, tensor, tensor.shape, tensor.dtype)
        rest, per_block = _partition(list(named.values()), blocks)
        return _bound(
            sum(slot.nbytes for slot in rest),
            [sum(slot.nbytes for slot in slots) for slots in per_block],
            options.resident_layers + options.prefetch + 1,
        )

    @property
    def footprint(self) -> int:
        """Return the non-block bytes + (``resident_layers + prefetch + 1``) x the largest block."""
        return _bound(
            self._rest.nbytes,
            [group.nbytes for group in self._blocks],
            self.resident_layers + self.prefetch_blocks + 1,
        )

    @property
    def is_resident(self) -> bool:
        """Whether the component is resident (its non-block weights on the device)."""
        return self._is_resident

    def onload(self) -> int:
        """Onload the non-block weights and the resident layers; return the bytes moved.

        Raises:
            OffloadError: a part could not be read; what was onloaded is undone.
        """
        self._check_open()
        if self._is_resident:
            return 0
        moved = 0
        done: list[Group] = []
        try:
            for group in (self._rest, *self._blocks[: self.resident_layers]):
                moved += group.onload()
                done.append(group)
        except BaseException:
            for group in done:
                group.discard()
            raise
        self._is_resident = True
        return moved

    def offload(self) -> int:
        """Take every part off the device; return the bytes freed.

        Raises:
            OffloadError: target ``disk`` and the file can no longer be written; nothing is freed.
        """
        self._check_open()
        if not self._is_resident:
            return 0
        if self._file is not None:
            self._file.ensure_written()
        freed = sum(group.offload() for group in (self._rest, *self._blocks))
        self._is_resident = False
        return freed

    def resident_bytes(self) -> int:
        """Return the bytes on the device now, blocks streamed in (or in flight) included."""
        return sum(group.held_bytes() for group in (self._rest, *self._blocks))

    def take_streamed(self) -> int:
        """Return the bytes of blocks streamed in and out since the last call: each block
        counted as it leaves the device, prefetched ones that never ran too (a block a
        forward does not call, under a step cache, streams nothing)."""
        streamed, self._streamed = self._streamed, 0
        return streamed

    def close(self) -> None:
        """Drop the file, then remove the hooks and drop the host copies.

        Raises:
            OSError: the file cannot be deleted; the store stays open and usable.
        """
        if self._is_closed:
            return
        if self._file is not None:
            self._file.remove()
        for handle in self._hooks:
            handle.remove()
        for group in (self._rest, *self._blocks):
            group.close()
        self._is_closed = True

    def _group(self, slots: list[Slot], *, resident: bool) -> Group:
        if self._file is not None:
            return DiskGroup(slots, self._file, self.device, resident=resident)
        group = HostGroup(slots, self.device, self._stream)
        if resident:
            group.onload()
        return group

    def _check_running(self) -> None:
        self._check_open()
        if not self._is_resident:
            raise OffloadError(
                f"{type(self.module).__name__} ran while its LayerwiseStore is offloaded, so "
                "its non-block weights are not on the device; onload() the store before "
                "running the module"
            )

    def _before_forward(self, module: nn.Module, args: tuple[object, ...]) -> None:
        # The blocks' placement is shared by every caller: one forward at a time. The
        # always-called forward hook releases the lock, also when the forward raises.
        self._running.acquire()
        self._runner = threading.get_ident()
        self._check_running()
        self.peak_bytes = self.resident_bytes()

    def _after_forward(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if self._runner != threading.get_ident():
            return  # an earlier pre-hook raised before this store's took the lock
        try:
            for group in self._blocks[self.resident_layers :]:
                self._streamed += group.offload()  # prefetched, never run
        finally:
            self._runner = None
            self._running.release()

    def _before_block(self, index: int, block: nn.Module, args: tuple[object, ...]) -> None:
        self._check_running()
        self._blocks[index].onload()
        ahead = min(index + 1 + self.prefetch_blocks, self._runs)
        for group in self._blocks[index + 1 : ahead]:
            group.prefetch()
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes())

    def _after_block(
        self, index: int, block: nn.Module, args: tuple[object, ...], output: object
    ) -> None:
        if index >= self.resident_layers:
            self._streamed += self._blocks[index].offload()


def _bound(rest: int, blocks: list[int], streamed: int) -> int:
    """Return the most bytes resident at once: the rest + ``streamed`` x the largest block."""
    return rest + min(len(blocks), streamed) * max(blocks, default=0)


def _check_arguments(
    module: nn.Module,
    blocks: nn.ModuleList,
    target: str,
    path: Path | str | None,
    prefetch: int,
    resident_layers: int,
) -> None:
    """Raise one OffloadError naming every argument a LayerwiseStore cannot use."""
    problems: list[str] = []
    if target not in ("host", "disk"):
        problems.append(f"target is {target!r}; use 'host' or 'disk'")
    if target == "disk" and path is None:
        problems.append("target 'disk' needs a path for its safetensors file")
    if target == "host" and path is not None:
        problems.append("target 'host' takes no path; drop it or use target 'disk'")
    problems += layerwise_problems(len(blocks), prefetch=prefetch, resident_layers=resident_layers)
    inside = {id(child) for child in module.modules()}
    if not all(id(block) in inside for block in blocks):
        problems.append(f"blocks are not submodules of {type(module).__name__}; pass its own")
    if problems:
        raise OffloadError(
            f"cannot build a LayerwiseStore for {type(module).__name__}: " + "; ".join(problems)
        )


def _partition(slots: list[Slot], blocks: nn.ModuleList) -> tuple[list[Slot], list[list[Slot]]]:
    """Split slots into non-block ones and one list per block.

    A slot belongs to a block only when every name it has is inside that block.
    """
    counts = [
        Counter(
            id(tensor)
            for _, tensor in chain(
                block.named_parameters(remove_duplicate=False),
                block.named_buffers(remove_duplicate=False),
            )
        )
        for block in blocks
    ]
    rest: list[Slot] = []
    per_block: list[list[Slot]] = [[] for _ in blocks]
    for slot in slots:
        owner = next(
            (
                index
                for index, count in enumerate(counts)
                if count[id(slot.tensor)] == len(slot.names)
            ),
            None,
        )
        (rest if owner is None else per_block[owner]).append(slot)
    return rest, per_block
