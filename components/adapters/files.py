"""An adapter file: LoRA matrices in diffusers' (PEFT's) key layout, read from its header.

A LoRA of a linear layer ``W`` (``out x in``) is a pair of matrices stored under the
layer's module path: ``<path>.lora_A.weight`` (``rank x in``) and ``<path>.lora_B.weight``
(``out x rank``); the layer then computes ``W x + scale * alpha / rank * B A x``. In
diffusers' pipeline layout every key starts with the component it adapts
(``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``); a file PEFT saves for one
model has no such prefix. ``alpha`` is the rank unless the file's metadata
(``lora_adapter_metadata``, as diffusers writes it) says otherwise; per-layer rank or
alpha patterns and DoRA are not read, and such a file is refused rather than misread.

Nothing here reads a tensor: admission works from the header alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from components.weights import StoredTensor, is_floating, read_header

__all__ = ["AdapterFile", "KeyProblem", "LoraTarget"]

LORA_A = "lora_A.weight"
"""The key ending of a layer's down projection (``rank x in``)."""
LORA_B = "lora_B.weight"
"""The key ending of a layer's up projection (``out x rank``)."""
METADATA_KEY = "lora_adapter_metadata"
"""Where diffusers writes the LoRA config (JSON) in a file's safetensors metadata."""


@dataclass(frozen=True)
class LoraTarget:
    """One linear layer an adapter changes, as its file stores it.

    Attributes:
        module: the layer's module path inside the component.
        rank: the rank of its two matrices.
        in_features: the width ``lora_A`` reads.
        out_features: the width ``lora_B`` writes.
        down_key: the file's key of ``lora_A`` (``rank x in``).
        up_key: the file's key of ``lora_B`` (``out x rank``).
    """

    module: str
    rank: int
    in_features: int
    out_features: int
    down_key: str
    up_key: str

    @property
    def numel(self) -> int:
        """The elements of both matrices."""
        return self.rank * (self.in_features + self.out_features)


@dataclass(frozen=True)
class AdapterFile:
    """What an adapter file's header says: its targets, its scaling, and what is wrong.

    Attributes:
        path: the file.
        prefix: the first dotted part every key shares (a component's name in diffusers'
            pipeline layout), or None when the keys share none.
        header: every tensor of the file by key.
        alpha_ratio: ``alpha / rank`` from the file's metadata (1.0 without any).
        problems: what makes the file unusable whatever the component: its metadata.
    """

    path: Path
    prefix: str | None
    header: dict[str, StoredTensor]
    alpha_ratio: float
    problems: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> AdapterFile:
        """Read the header (and metadata) of the adapter file at ``path``.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not a safetensors file (the message names it).
        """
        header = read_header(path)
        heads = {key.split(".", 1)[0] for key in header if "." in key}
        prefix = heads.pop() if len(heads) == 1 and all("." in key for key in header) else None
        ratio, problems = _alpha_ratio(_metadata(path), prefix)
        return cls(path, prefix, header, ratio, tuple(problems))

    def targets(self, strip: str | None) -> tuple[dict[str, LoraTarget], list[KeyProblem]]:
        """Group the keys into one target per layer, with ``strip.`` taken off each key.

        Returns the targets by module path and the problems of keys that are not a
        LoRA pair of 2-D floating matrices whose ranks agree, in key order.
        """
        pairs: dict[str, dict[str, str]] = {}
        problems: list[KeyProblem] = []
        for key in sorted(self.header):
            name = key[len(strip) + 1 :] if strip is not None else key
            for ending in (LORA_A, LORA_B):
                if name.endswith("." + ending):
                    pairs.setdefault(name[: -len(ending) - 1], {})[ending] = key
                    break
            else:
                problems.append(
                    KeyProblem(
                        key,
                        f"key '{key}' is not a LoRA matrix (a key ends in .{LORA_A} or .{LORA_B})",
                    )
                )
        targets: dict[str, LoraTarget] = {}
        for module, keys in pairs.items():
            problem = self._pair_problem(module, keys)
            if problem is not None:
                problems.append(problem)
                continue
            down, up = self.header[keys[LORA_A]].shape, self.header[keys[LORA_B]].shape
            targets[module] = LoraTarget(
                module, down[0], down[1], up[0], keys[LORA_A], keys[LORA_B]
            )
        return targets, sorted(problems)

    def _pair_problem(self, module: str, keys: dict[str, str]) -> KeyProblem | None:
        if len(keys) == 1:
            (ending, key), *_ = keys.items()
            other = LORA_B if ending == LORA_A else LORA_A
            return KeyProblem(key, f"key '{key}' has no .{other} beside it for layer '{module}'")
        for key in keys.values():
            stored = self.header[key]
            if len(stored.shape) != 2 or not is_floating(stored):
                return KeyProblem(
                    key,
                    f"key '{key}' is a {stored.dtype} tensor of shape {list(stored.shape)}, "
                    "not a 2-D floating-point matrix",
                )
        down, up = self.header[keys[LORA_A]].shape, self.header[keys[LORA_B]].shape
        if down[0] != up[1]:
            return KeyProblem(
                keys[LORA_A],
                f"key '{keys[LORA_A]}' has shape {list(down)} (rank {down[0]}) but "
                f"'{keys[LORA_B]}' has shape {list(up)} (rank {up[1]}): the ranks disagree",
            )
        return None


@dataclass(frozen=True, order=True)
class KeyProblem:
    """Why one key of an adapter file cannot apply (the first one is what admission names).

    Attributes:
        key: the file's key.
        message: what is wrong with it, with the shapes.
    """

    key: str
    message: str


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(path, framework="pt") as file:
        found: dict[str, str] = file.metadata() or {}
    return found


def _alpha_ratio(metadata: dict[str, str], prefix: str | None) -> tuple[float, list[str]]:
    """Return ``alpha / rank`` from diffusers' LoRA metadata, and what cannot be honoured."""
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return 1.0, []
    try:
        config = json.loads(raw)
    except ValueError:
        return 1.0, [f"its {METADATA_KEY} metadata is not JSON"]
    if not isinstance(config, dict):
        return 1.0, [f"its {METADATA_KEY} metadata is not a JSON object"]
    if prefix is not None and f"{prefix}.r" in config:  # diffusers prefixes a pipeline's keys
        config = {k[len(prefix) + 1 :]: v for k, v in config.items() if k.startswith(prefix + ".")}
    problems = [
        f"its metadata sets {key} (per-layer ranks, alphas or DoRA are not applied here)"
        for key in ("rank_pattern", "alpha_pattern", "use_dora")
        if config.get(key)
    ]
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int | float) or not isinstance(alpha, int | float) or rank <= 0:
        return 1.0, problems
    return float(alpha) / float(rank), problems
