"""Weights files: sized from their safetensors header, refused clearly when malformed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from components.weights import load_weights, seed_weights, stored_bytes

FIX = (
    "write it with safetensors (save_file or save_model), or point options.weights at another file"
)


def write_raw(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    """Write a file laid out as safetensors: 8-byte little-endian length, header, data."""
    size = len(header) if length is None else length
    path.write_bytes(size.to_bytes(8, "little") + header + data)
    return path


def entry(**fields: object) -> bytes:
    """Return a JSON header with one tensor ``t`` described by ``fields``."""
    return json.dumps({"t": fields}).encode()


def assert_refused(read: Callable[[Path], object], path: Path, reason: str) -> None:
    """Check ``read(path)`` raises a ValueError naming the file, safetensors' reason and the fix."""
    with pytest.raises(ValueError, match="is not a valid safetensors file") as err:
        read(path)
    message = str(err.value)
    assert message.startswith(f"weights file {path} is not a valid safetensors file (")
    assert reason in message
    assert message.endswith(f"); {FIX}")


# (label, header, data, length written, what safetensors says): none of them is safetensors
MALFORMED = [
    ("not JSON", b"hello", b"", None, "invalid JSON in header"),
    ("a JSON list", b"[]", b"", None, "invalid JSON in header"),
    ("no offsets", entry(dtype="F32", shape=[2]), b"\0" * 8, None, "missing field `data_offsets`"),
    ("unknown dtype", entry(dtype="Q7", shape=[2], data_offsets=[0, 8]), b"\0" * 8, None, "Q7"),
    (
        "data too short",
        entry(dtype="F32", shape=[2], data_offsets=[0, 8]),
        b"\0" * 4,
        None,
        "incomplete metadata",
    ),
    ("length past the end", b"{}", b"", 1000, "invalid header length"),
]


class TestStoredBytes:
    """``stored_bytes``: the size of a weights file's tensors, from its header alone."""

    def test_sums_every_dtype(self, tmp_path: Path) -> None:
        """Tensors of several dtypes add up to exactly their bytes."""
        tensors = {
            "f32": torch.zeros(3, 5),
            "bf16": torch.zeros(7, dtype=torch.bfloat16),
            "i64": torch.zeros(2, 2, dtype=torch.int64),
            "flag": torch.zeros(3, dtype=torch.bool),
            "scalar": torch.zeros((), dtype=torch.float16),
        }
        path = tmp_path / "mixed.safetensors"
        save_file(tensors, str(path))
        assert stored_bytes(path) == sum(t.nbytes for t in tensors.values()) == 60 + 14 + 32 + 3 + 2

    @pytest.mark.parametrize(
        ("header", "data", "length", "reason"),
        [case[1:] for case in MALFORMED],
        ids=[case[0] for case in MALFORMED],
    )
    def test_malformed_header_is_a_value_error(
        self, tmp_path: Path, header: bytes, data: bytes, length: int | None, reason: str
    ) -> None:
        """A malformed header is a ValueError naming the file and the fix, never a KeyError."""
        path = write_raw(tmp_path / "bad.safetensors", header, data, length)
        assert_refused(stored_bytes, path, reason)

    @pytest.mark.parametrize("length", [100_000_001, 2**40, 2**64 - 1])
    def test_oversized_header_is_refused_unread(self, tmp_path: Path, length: int) -> None:
        """A header length over safetensors' 100 MB bound is refused before anything is read."""
        path = write_raw(tmp_path / "huge.safetensors", b"{}", length=length)
        assert_refused(stored_bytes, path, "header too large")

    def test_file_shorter_than_the_length_prefix(self, tmp_path: Path) -> None:
        """A file too short to hold the 8-byte length is refused the same way."""
        path = tmp_path / "short.safetensors"
        path.write_bytes(b"abc")
        assert_refused(stored_bytes, path, "header too small")

    def test_missing_file_is_file_not_found(self, tmp_path: Path) -> None:
        """A file that does not exist is FileNotFoundError, which admission treats as unknown."""
        with pytest.raises(FileNotFoundError):
            stored_bytes(tmp_path / "gone.safetensors")


class TestLoadWeights:
    """``load_weights``: a file's tensors copied into a module, or a clear refusal."""

    def test_malformed_file_is_a_value_error(self, tmp_path: Path) -> None:
        """Loading from a malformed file names the file; the module keeps its weights."""
        module = nn.Linear(2, 2)
        seed_weights(module, 0)
        before = {name: t.clone() for name, t in module.state_dict().items()}
        path = write_raw(tmp_path / "bad.safetensors", b"[]")
        assert_refused(lambda p: load_weights(module, p), path, "invalid JSON in header")
        assert all(torch.equal(before[name], t) for name, t in module.state_dict().items())

    def test_round_trip(self, tmp_path: Path) -> None:
        """Weights written by safetensors are copied into the module in place."""
        source, target = nn.Linear(3, 2), nn.Linear(3, 2)
        seed_weights(source, 1)
        seed_weights(target, 2)
        path = tmp_path / "linear.safetensors"
        save_file(dict(source.state_dict()), str(path))
        weight = target.weight
        load_weights(target, path)
        assert target.weight is weight
        assert torch.equal(target.weight, source.weight)
        assert torch.equal(target.bias, source.bias)
