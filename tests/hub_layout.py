"""Pipeline folders as the Hugging Face Hub ships them, and a Hugging Face cache holding them.

``cache_repo`` stores a folder in huggingface_hub's own cache layout
(``models--ORG--NAME/blobs``, ``snapshots/COMMIT`` of relative links to the blobs,
``refs/BRANCH``), as a download would. ``hub_folder`` copies a tiny folder and adds what
real repositories carry beside it: a README, ``.gitattributes``, pickled ``.bin`` weights
that must never be opened, ``fp16`` variant files holding other values, a sharded index.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

POISON = "a pickled .bin was unpickled"
"""What unpickling one of ``hub_folder``'s ``.bin`` files raises (it never should be)."""
WEIGHTS = {"diffusion_pytorch_model", "model"}


def commit_of(text: str) -> str:
    """Return a commit hash made from ``text`` (40 hex digits, as the Hub's)."""
    return hashlib.sha1(text.encode()).hexdigest()


def cache_repo(
    cache: Path, repo: str, folder: Path, commit: str, refs: Mapping[str, str] | None = None
) -> Path:
    """Store ``folder`` in ``cache`` as revision ``commit`` of ``repo``; return its snapshot.

    Every file becomes a blob named by its SHA-256, linked from the snapshot by a relative
    symlink, as huggingface_hub lays a download out; ``refs`` (branch -> commit; default
    ``main`` -> ``commit``) are written to ``refs/``.
    """
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for branch, target in (refs if refs is not None else {"main": commit}).items():
        ref = storage / "refs" / branch
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(target)  # no newline, as huggingface_hub writes it
    return snapshot


class _Poison:
    """Pickles to a call that raises: a ``.bin`` of it fails loudly if ever unpickled."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"raise RuntimeError({POISON!r})",))


def hub_folder(folder: Path, into: Path, *, shard: str = "transformer") -> Path:
    """Copy ``folder`` to ``into`` laid out as its hub repository ships; return ``into``.

    Beside each component's safetensors weights: a pickled ``.bin`` that raises when
    unpickled, and an ``fp16`` variant holding other values (each weight plus 5% of its
    spread, seeded, stored as float16); the ``shard`` component's variant is split in two
    shards under a ``.safetensors.index.fp16.json``. A README and ``.gitattributes`` lie at
    the top and in every subfolder.
    """
    shutil.copytree(folder, into)
    for place in (into, *(p for p in into.iterdir() if p.is_dir())):
        (place / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A tiny model\n")
        (place / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    for weights in sorted(into.glob("*/*.safetensors")):
        stem = weights.name.removesuffix(".safetensors")
        if stem not in WEIGHTS:
            continue
        pickled = "pytorch_model.bin" if stem == "model" else f"{stem}.bin"
        (weights.parent / pickled).write_bytes(pickle.dumps(_Poison()))
        variant = _other_values(load_file(weights), weights.parent.name)
        if weights.parent.name == shard:
            _write_shards(variant, weights.parent, stem)
        else:
            save_file(variant, weights.parent / f"{stem}.fp16.safetensors")
    return into


def _other_values(tensors: dict[str, torch.Tensor], seed: str) -> dict[str, torch.Tensor]:
    """Return ``tensors`` moved by 5% of each one's spread (seeded by ``seed``), in float16."""
    generator = torch.Generator().manual_seed(int(commit_of(seed)[:8], 16))
    moved = {}
    for name, tensor in sorted(tensors.items()):
        if tensor.is_floating_point():
            noise = torch.randn(tensor.shape, generator=generator)
            spread = tensor.float().std() if tensor.numel() > 1 else tensor.float().abs()
            tensor = (tensor.float() + 0.05 * noise * spread.nan_to_num(0.0)).half()
        moved[name] = tensor.contiguous()
    return moved


def _write_shards(tensors: dict[str, torch.Tensor], folder: Path, stem: str) -> None:
    """Write ``tensors`` as two fp16 shards of ``stem`` and their index, as diffusers names them."""
    names = sorted(tensors)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    weight_map = {}
    for number, half in enumerate(halves, start=1):
        shard = f"{stem}.fp16-{number:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in half}, folder / shard)
        weight_map.update(dict.fromkeys(half, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.fp16.json").write_text(json.dumps(index, indent=2))
