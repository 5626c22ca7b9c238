"""Constructors draw no random values that a seed, a weights file or the meta device discards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from components import registry as kinds
from components.loader import SeededOptions
from components.random_fills import built_on_meta
from components.weights import seed_weights
from tests.components.fills import Fills
from tests.components.standalone import STANDALONE_KINDS

SEEDED = [
    name for name in STANDALONE_KINDS if issubclass(kinds.get(name).options_type, SeededOptions)
]


@pytest.mark.parametrize("kind", SEEDED)
def test_a_seeded_build_draws_nothing_and_keeps_its_weights(kind: str) -> None:
    """Building a seeded kind fills no parameter at random, and its weights are the seed's."""
    loader = kinds.get(kind).from_options({})
    with Fills() as fills:
        module = loader.build("custom")
    assert not [t for t in fills.filled if isinstance(t, nn.Parameter)]
    expected = loader.construct("custom")  # drawn at random, then overwritten
    seed_weights(expected, loader.options.seed_value)
    got = module.state_dict()
    assert got.keys() == expected.state_dict().keys()
    for name, tensor in expected.state_dict().items():
        assert torch.equal(got[name], tensor), name


def test_a_build_from_a_weights_file_draws_nothing() -> None:
    """The MiniLM encoder, whose weights file is shipped, builds without drawing its 11.7 M
    embedding values."""
    loader = kinds.get("minilm_text_encoder").from_options({})
    if loader.unavailable_reason("custom") is not None:
        pytest.skip(str(loader.unavailable_reason("custom")))
    with Fills() as fills:
        module = loader.build("custom")
    assert not [t for t in fills.filled if isinstance(t, nn.Parameter)]
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("kind", STANDALONE_KINDS)
def test_a_meta_build_draws_nothing(kind: str) -> None:
    """What admission builds on the meta device runs no initialiser and allocates nothing."""
    loader = kinds.get(kind).from_options({})
    if loader.unavailable_reason("custom") is not None:
        pytest.skip(str(loader.unavailable_reason("custom")))
    with Fills() as fills:
        module = built_on_meta(lambda: loader.construct("custom"))
    assert fills.filled == []
    assert all(p.is_meta for p in module.parameters())
