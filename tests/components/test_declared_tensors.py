"""Each kind declares its tensors from its options, and the declaration is exact."""

from __future__ import annotations

from typing import Any, get_args

import pytest
import torch

from components import registry
from components.loader import LoaderPath
from tests.components.standalone import STANDALONE_KINDS

CASES: list[tuple[str, dict[str, Any]]] = [
    *((kind, {}) for kind in STANDALONE_KINDS),
    ("tiny_text_encoder", {"dim": 48, "heads": 6, "layers": 3, "vocab_size": 100}),
    ("tiny_dit", {"context_dim": 24, "layers": 3, "in_channels": 6}),
    ("tiny_vae", {"channels": 16, "groups": 4, "latent_channels": 6}),
    ("tiny_upsampler", {"channels": 8}),
]


@pytest.mark.parametrize(
    ("kind", "options", "path"),
    [(k, o, p) for k, o in CASES for p in get_args(LoaderPath) if registry.get(k).has_path(p)],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "",
)
def test_declaration_equals_every_built_path(
    kind: str, options: dict[str, Any], path: LoaderPath
) -> None:
    """The declared names, shapes and float-ness equal each path's state dict."""
    loader = registry.get(kind).from_options(options)
    reason = loader.unavailable_reason(path)
    if reason is not None:  # an optional library or weights package is not installed
        pytest.skip(reason)
    with torch.device("meta"):  # shapes only: no weight is made
        module = loader.build_custom() if path == "custom" else loader.build_native()
    built = {n: (tuple(t.shape), t.is_floating_point()) for n, t in module.state_dict().items()}
    declared = loader.tensors()
    assert declared is not None
    assert {n: (d.shape, d.floating) for n, d in declared.items()} == built
