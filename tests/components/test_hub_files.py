"""Which weights files of a component folder are read: safetensors of the variant asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.folders.files import UnsafeWeightsError, Variant, VariantError, weight_files


def folder_of(tmp_path: Path, *names: str) -> Path:
    """Return a component folder holding empty files of ``names`` (names are all that count)."""
    for name in names:
        (tmp_path / name).write_bytes(b"")
    return tmp_path


SHIPPED = (
    "README.md",
    ".gitattributes",
    "config.json",
    "diffusion_pytorch_model.bin",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.fp16.safetensors",
    "flax_model.msgpack",
)


class TestWeightFiles:
    @pytest.mark.parametrize(
        ("variant", "found"),
        [
            (None, "diffusion_pytorch_model.safetensors"),
            ("fp16", "diffusion_pytorch_model.fp16.safetensors"),
        ],
    )
    def test_the_asked_variant_is_read_and_nothing_else(
        self, tmp_path: Path, variant: Variant | None, found: str
    ) -> None:
        """Beside a README, pickles and other frameworks' weights, the safetensors file of
        the variant asked for (none: the full one) is the one read."""
        folder = folder_of(tmp_path, *SHIPPED)
        assert weight_files(folder, variant) == (folder / found,)

    def test_an_asked_variant_the_folder_lacks_names_what_it_has(self, tmp_path: Path) -> None:
        """No bf16 files: a VariantError with the variants there and every weights file."""
        folder = folder_of(tmp_path, *SHIPPED)
        with pytest.raises(VariantError) as err:
            weight_files(folder, "bf16")
        assert (err.value.variant, err.value.variants) == ("bf16", [None, "fp16"])
        assert err.value.files == [
            "diffusion_pytorch_model.bin",
            "diffusion_pytorch_model.fp16.safetensors",
            "diffusion_pytorch_model.safetensors",
        ]

    def test_variant_shards_are_named_by_their_index(self, tmp_path: Path) -> None:
        """A variant's shard index (``model.safetensors.index.fp16.json``) lists its shards;
        the folder then has the fp16 variant and no other."""
        shards = [f"model.fp16-0000{i}-of-00002.safetensors" for i in (1, 2)]
        folder = folder_of(tmp_path, *shards)
        index = {"weight_map": {"a": shards[0], "b": shards[1]}}
        (folder / "model.safetensors.index.fp16.json").write_text(json.dumps(index))
        assert weight_files(folder, "fp16") == tuple(folder / s for s in shards)
        with pytest.raises(VariantError) as err:
            weight_files(folder)
        assert err.value.variants == ["fp16"]

    def test_pickles_alone_stay_unsafe(self, tmp_path: Path) -> None:
        """With no safetensors of any variant, pickled files are refused as before."""
        folder = folder_of(tmp_path, "pytorch_model.bin", "pytorch_model.fp16.bin")
        with pytest.raises(UnsafeWeightsError):
            weight_files(folder, "fp16")
