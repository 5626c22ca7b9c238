"""Disk-offload files: each tensor where its weight lay, a valid safetensors file, the same bits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from components.offload import DiskStore, OffloadError
from components.offload.aligned_file import PADDING
from components.offload.base import collect_slots
from tests.components.standalone import STANDALONE_KINDS
from tests.components.test_kinds import buildable
from tests.components.test_offload import build, run
from tests.conftest import PipelineFolders
from tests.processes import run_python

DIT_FAMILIES = ("pixart", "flux", "sd3")


def file_offsets(path: Path) -> dict[str, int]:
    """Return where each tensor of the safetensors file at ``path`` starts in the file."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items()}


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    """Return the tensors safetensors reads from ``path``, padding left out."""
    return {name: t for name, t in load_file(path).items() if not name.startswith(PADDING)}


def move_off_boundary(module: nn.Module, offset: int) -> None:
    """Put every parameter and buffer of ``module`` ``offset`` bytes past a 64-byte boundary,
    as weights mapped from a model's own file may lie."""
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            nbytes = tensor.numel() * tensor.element_size()
            room = torch.empty(nbytes + 64, dtype=torch.uint8).untyped_storage()
            own = torch.empty(0, dtype=torch.uint8).set_(room[offset : offset + nbytes])
            moved = own.view(tensor.dtype).view(tensor.shape)  # a storage of its own, as mapped
            moved.copy_(tensor)
            tensor.data = moved


class TestLayout:
    @pytest.mark.parametrize("kind", STANDALONE_KINDS)
    def test_every_tensor_starts_at_a_boundary(self, kind: str, tmp_path: Path) -> None:
        """Each weight of a kind's offload file starts at a 64-byte boundary; safetensors
        reads the file back, every weight equal, the padding zeros."""
        module = buildable(kind).build("custom")
        expected = {slot.key: slot.tensor.detach().clone() for slot in collect_slots(module)}
        path = tmp_path / f"{kind}.safetensors"
        DiskStore(module, path, "cpu")
        offsets = file_offsets(path)
        assert {name: offsets[name] % 64 for name in expected} == dict.fromkeys(expected, 0)
        stored = weights_of(path)
        assert stored.keys() == expected.keys()
        for name, tensor in stored.items():
            assert torch.equal(tensor, expected[name]), name
        padding = [t for name, t in load_file(path).items() if name.startswith(PADDING)]
        assert all(pad.dtype == torch.uint8 and 0 < pad.numel() < 64 for pad in padding)
        assert not any(pad.any() for pad in padding)

    def test_a_weight_off_a_boundary_keeps_its_place(self, tmp_path: Path) -> None:
        """A weight 8 bytes past a boundary is stored, and mapped back, 8 bytes past one."""
        model = build()
        move_off_boundary(model, 8)
        expected = run(model)
        path = tmp_path / "lm.safetensors"
        store = DiskStore(model, path, "cpu")
        offsets = file_offsets(path)
        assert {offsets[name] % 64 for name in weights_of(path)} == {8}
        store.onload()
        assert {t.data_ptr() % 64 for t in (*model.parameters(), *model.buffers())} == {8}
        assert torch.equal(run(model), expected)

    def test_a_dtype_safetensors_cannot_name_is_refused(self, tmp_path: Path) -> None:
        """A weight of a dtype the format has no name for fails the offload, naming the dtype;
        the module keeps its weights and no file is left."""
        model = nn.Module()
        model.register_buffer("phase", torch.ones(4, dtype=torch.complex128))
        path = tmp_path / "complex.safetensors"
        with pytest.raises(OffloadError, match=r"dtype torch.complex128 has no name in the"):
            DiskStore(model, path, "cpu")
        assert model.get_buffer("phase").numel() == 4
        assert list(tmp_path.iterdir()) == []


def cases(result: Any) -> dict[str, dict[str, Any]]:
    """Return the cases ``tests.components.offload_bits`` printed; skip where its premise fails."""
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    if not lines[0]["premise"]:
        pytest.skip("no BLAS kernel here computes other bits for a weight off a boundary")
    return {line["case"]: line for line in lines[1:]}


class TestSameBits:
    """Offloaded, a component computes the bits it computes resident.

    Each test runs in a program of its own under ``MKL_ENABLE_INSTRUCTIONS=SSE4_2``:
    MKL's SSE4.2 kernels give other bits for a one-row product whose weight lies 8
    bytes past a 64-byte boundary (as ``save_file`` placed them); its AVX-512 ones on
    this kind of machine do not, and the AVX2 ones of the machine the issue came from did.
    """

    def test_tiny_pipeline(
        self, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The tiny pipeline with a six-layer DiT makes the same images resident and offloaded
        whole or layerwise, to the host or to disk."""
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
        spec = root / "examples" / "tiny_t2i.toml"
        found = cases(
            run_python(
                "tests.components.offload_bits", "tiny", spec, tmp_path, cwd=root, module=True
            )
        )
        assert {case: line["max_abs"] for case, line in found.items()} == {
            f"tiny-t2i {store}": 0.0
            for store in ("component host", "component disk", "layerwise host", "layerwise disk")
        }
        assert all(line["equal"] for line in found.values())

    def test_folder_dits(
        self,
        pipeline_folder: PipelineFolders,
        root: Path,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Each folder's DiT gives the same output as loaded (its weights mapped from the
        folder's file, Flux's 24 bytes past a boundary) and through each store."""
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
        folders = [f"{family}={pipeline_folder(family)}" for family in DIT_FAMILIES]
        found = cases(
            run_python(
                "tests.components.offload_bits",
                "folder",
                *folders,
                tmp_path,
                cwd=root,
                module=True,
                timeout=240,
            )
        )
        assert {case: line["max_abs"] for case, line in found.items()} == {
            f"{family} {store}": 0.0
            for family in DIT_FAMILIES
            for store in ("component host", "component disk", "layerwise host", "layerwise disk")
        }
        assert all(line["equal"] for line in found.values())
