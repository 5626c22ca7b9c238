"""Disk offload files: mapped onload, coalesced reads, verification, read-ahead, the factory."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from components import ResidencyMode
from components.accounting import module_bytes
from components.offload import (
    DiskStore,
    HostStore,
    LayerwiseStore,
    OffloadError,
    StoreOptions,
    device_footprint,
    make_store,
)
from components.offload.base import collect_slots
from components.offload.disk_file import SETTLED_NS, DiskFile, hash_is_trusted
from tests.components.test_offload import all_tensors, build, run


def zero_in_place(path: Path, tensor: torch.Tensor) -> None:
    """Zero ``tensor``'s bytes in the file in place, keeping size, inode and mtime.

    Only a checksum of the data can see this change.
    """
    data = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    offset = path.read_bytes().find(data)
    assert offset > 0
    status = path.stat()
    path.chmod(0o600)
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(bytes(len(data)))
    path.chmod(status.st_mode)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


def no_file() -> Path:
    """Stand in for a file path that must never be asked for."""
    raise AssertionError("a store asked for a file path it must not need")


class TestMappedOnload:
    def test_cpu_onload_maps_the_file(self, tmp_path: Path) -> None:
        """On a CPU device the onloaded weights are pages of the file, not a private copy."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu")
        store.onload()
        maps = Path("/proc/self/maps").read_text().splitlines()
        mapped = [
            (int(low, 16), int(high, 16))
            for low, high, line in (
                (*line.split()[0].split("-"), line) for line in maps if str(path) in line
            )
        ]
        assert mapped
        pointer = model.embed.weight.data_ptr()
        assert any(low <= pointer < high for low, high in mapped)
        assert torch.equal(run(model), run(build()))

    def test_accounting_stays_per_tensor(self, tmp_path: Path) -> None:
        """Mapped tensors each own a slice of the map, so accounted bytes equal the model's."""
        model = build()
        store = DiskStore(model, tmp_path / "lm.safetensors", "cpu")
        store.onload()
        assert module_bytes(model) == module_bytes(build()) == store.nbytes

    def test_map_is_dropped_with_the_weights(self, tmp_path: Path) -> None:
        """Offload drops every reference to the map, so the file is no longer mapped."""
        path = tmp_path / "lm.safetensors"
        store = DiskStore(build(), path, "cpu")
        store.onload()
        store.offload()
        assert str(path) not in Path("/proc/self/maps").read_text()

    def test_staged_read_coalesces_adjacent_tensors(self, tmp_path: Path) -> None:
        """Off a CPU device the tensors are read into one staging buffer, equal to the weights."""
        model = build()
        slots = collect_slots(model)
        file = DiskFile(tmp_path / "lm.safetensors", slots)
        file.ensure_written()
        tensors = file.read(slots, torch.device("meta"))
        pointers = sorted(tensor.data_ptr() for tensor in tensors if tensor.numel())
        span = pointers[-1] - pointers[0]
        assert span < sum(slot.nbytes for slot in slots)  # all inside one buffer
        for slot, tensor in zip(slots, tensors, strict=True):
            assert torch.equal(tensor, slot.tensor), slot.key


class TestVerifiedFile:
    def test_written_file_is_read_only(self, tmp_path: Path) -> None:
        """Once written, the offload file is readable by its owner only and writable by nobody."""
        path = tmp_path / "lm.safetensors"
        DiskStore(build(), path, "cpu")
        assert stat.S_IMODE(path.stat().st_mode) == 0o400

    def test_zeroed_data_is_refused_by_the_checksum(self, tmp_path: Path) -> None:
        """Data zeroed in place with size and mtime kept is refused; the module stays out."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu")
        zero_in_place(path, build().embed.weight)
        with pytest.raises(OffloadError, match="differ from its checksum"):
            store.onload()
        assert not store.is_resident
        assert all(tensor.numel() == 0 for _, tensor in all_tensors(model))

    @pytest.mark.parametrize(
        ("verify", "reason"),
        [("checksum", "differ from its checksum"), ("stat", "size, mtime, ctime or inode differ")],
    )
    def test_another_seeds_file_is_refused(self, tmp_path: Path, verify: str, reason: str) -> None:
        """A file of another seed, its header identical, is refused by either verification."""
        path = tmp_path / "lm.safetensors"
        model = build(seed=0)
        store = DiskStore(model, path, "cpu", verify=verify)  # type: ignore[arg-type]
        other = tmp_path / "other.safetensors"
        DiskStore(build(seed=1), other, "cpu")
        assert path.read_bytes()[:200] == other.read_bytes()[:200]
        os.replace(other, path)
        with pytest.raises(OffloadError, match=reason):
            store.onload()
        assert module_bytes(model) == 0

    def test_intact_copy_passes_the_checksum(self, tmp_path: Path) -> None:
        """A byte-identical copy under the same name still onloads: the checksum decides."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = DiskStore(model, path, "cpu")
        copy = tmp_path / "copy.safetensors"
        shutil.copyfile(path, copy)
        os.replace(copy, path)
        store.onload()
        assert torch.equal(run(model), run(build()))

    def test_a_settled_version_is_hashed_once(self, tmp_path: Path) -> None:
        """Once a settled file's slots hashed clean, reads trust its identity until it changes."""
        path = tmp_path / "lm.safetensors"
        slots = collect_slots(build())
        file = DiskFile(path, slots)
        file.ensure_written()
        time.sleep(2 * SETTLED_NS / 1e9)
        assert file.will_hash(slots)
        file.read(slots, torch.device("cpu"))
        assert not file.will_hash(slots)
        zero_in_place(path, build().embed.weight)  # chmod and write set a new ctime
        assert file.will_hash(slots)
        with pytest.raises(OffloadError, match="differ from its checksum"):
            file.read(slots, torch.device("cpu"))

    def test_a_hash_vouches_only_for_a_settled_file(self, tmp_path: Path) -> None:
        """A hash that started within a timestamp tick of the file's ctime is not trusted."""
        path = tmp_path / "f"
        path.write_bytes(b"x")
        status = path.stat()
        assert not hash_is_trusted(status, status.st_ctime_ns)
        assert not hash_is_trusted(status, status.st_ctime_ns + SETTLED_NS - 1)
        assert hash_is_trusted(status, status.st_ctime_ns + SETTLED_NS)

    def test_layerwise_block_reads_are_verified(self, tmp_path: Path) -> None:
        """A layerwise forward refuses a block whose data changed, and streams it back out."""
        path = tmp_path / "lm.safetensors"
        model = build()
        store = LayerwiseStore(model, model.blocks, target="disk", path=path, device="cpu")
        store.onload()
        resident = store.resident_bytes()
        zero_in_place(path, build().blocks[2].get_parameter("up.weight"))
        with pytest.raises(OffloadError, match=r"blocks\.2\.up\.weight differ from its checksum"):
            run(model)
        assert store.resident_bytes() == resident
        assert all(tensor.numel() == 0 for _, tensor in all_tensors(model.blocks[2]))


class TestReadAhead:
    def test_read_later_reads_on_the_reader_thread(self, tmp_path: Path) -> None:
        """A read started early (off a CPU device) runs on the file's own thread, verified."""
        path = tmp_path / "ahead.safetensors"
        slots = collect_slots(build())
        file = DiskFile(path, slots)
        file.ensure_written()
        pending = file.read_later(slots, torch.device("meta"))
        assert any(t.name.startswith(f"read {path.name}") for t in threading.enumerate())
        for slot, tensor in zip(slots, pending.result(), strict=True):
            assert torch.equal(tensor, slot.tensor), slot.key
        file.remove()
        assert not any(t.name.startswith(f"read {path.name}") for t in threading.enumerate())

    def test_failed_early_read_reports_the_missing_file(self, tmp_path: Path) -> None:
        """A read started early on a file deleted since raises the missing-file error."""
        path = tmp_path / "gone.safetensors"
        slots = collect_slots(build())
        file = DiskFile(path, slots)
        file.ensure_written()
        path.unlink()
        with pytest.raises(OffloadError, match="is missing"):
            file.read_later(slots, torch.device("meta")).result()
        file.remove()

    @pytest.mark.parametrize("prefetch", [0, 1])
    def test_cpu_layerwise_reads_in_line(self, tmp_path: Path, prefetch: int) -> None:
        """On a CPU device a layerwise disk forward starts no reader thread, prefetch or not."""
        path = tmp_path / "inline.safetensors"
        model = build()
        store = LayerwiseStore(
            model, model.blocks, target="disk", path=path, device="cpu", prefetch=prefetch
        )
        store.onload()
        output = run(model)
        assert not any(t.name.startswith(f"read {path.name}") for t in threading.enumerate())
        assert torch.equal(output, run(build()))


class TestFactory:
    @pytest.mark.parametrize(
        ("mode", "target", "expected"),
        [
            (ResidencyMode.RESIDENT, "host", HostStore),
            (ResidencyMode.RESIDENT, "disk", HostStore),
            (ResidencyMode.COMPONENT_OFFLOAD, "host", HostStore),
            (ResidencyMode.COMPONENT_OFFLOAD, "disk", DiskStore),
            (ResidencyMode.LAYERWISE_OFFLOAD, "host", LayerwiseStore),
            (ResidencyMode.LAYERWISE_OFFLOAD, "disk", LayerwiseStore),
        ],
    )
    def test_mode_and_target_choose_the_store(
        self, tmp_path: Path, mode: ResidencyMode, target: str, expected: type
    ) -> None:
        """Each mode and target gets its store, and only a disk store asks for a file."""
        model = build()
        file = (lambda: tmp_path / "lm.safetensors") if expected is not HostStore else no_file
        if mode is ResidencyMode.LAYERWISE_OFFLOAD and target == "host":
            file = no_file
        options = StoreOptions(device=torch.device("cpu"), file=file, blocks=model.blocks)
        store = make_store(model, mode, target, options)  # type: ignore[arg-type]
        assert type(store) is expected
        assert store.target == target or expected is HostStore

    def test_layerwise_without_blocks_is_refused(self, tmp_path: Path) -> None:
        """A layerwise component without a block stack is an error, never a whole-module store."""
        options = StoreOptions(device=torch.device("cpu"), file=lambda: tmp_path / "m.st")
        with pytest.raises(OffloadError, match="layerwise offload streams a block stack"):
            make_store(nn.Linear(4, 4), ResidencyMode.LAYERWISE_OFFLOAD, "disk", options)
        assert not (tmp_path / "m.st").exists()

    @pytest.mark.parametrize("mode", list(ResidencyMode))
    def test_footprint_before_and_after_the_store(
        self, tmp_path: Path, mode: ResidencyMode
    ) -> None:
        """The footprint known before the store exists is the one the built store reports."""
        model = build()
        options = StoreOptions(
            device=torch.device("cpu"),
            file=lambda: tmp_path / "lm.safetensors",
            blocks=model.blocks,
            prefetch=1,
            resident_layers=1,
        )
        before = device_footprint(model, mode, "disk", options)
        store = make_store(model, mode, "disk", options)
        assert store.footprint == before
        if mode is ResidencyMode.LAYERWISE_OFFLOAD:
            block = module_bytes(build().blocks[0])
            assert before == module_bytes(build()) - len(model.blocks) * block + 3 * block
        else:
            assert before == module_bytes(build())
