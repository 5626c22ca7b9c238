"""The block stack a kind declares from its options is the one it builds."""

from __future__ import annotations

import pytest
from torch import nn

from components import registry as kinds
from tests.components.standalone import STANDALONE_KINDS

STREAMED = [name for name in STANDALONE_KINDS if kinds.get(name).block_stack is not None]


@pytest.mark.parametrize("kind", STREAMED)
def test_declared_block_count_is_built(kind: str) -> None:
    """block_count() from the options equals the length of the stack the custom path builds."""
    loader = kinds.get(kind).from_options({})
    stack = getattr(loader.build("custom"), str(loader.block_stack))
    assert isinstance(stack, nn.ModuleList)
    assert loader.block_count() == len(stack)


def test_kinds_without_a_stack_declare_no_count() -> None:
    """A kind with no block stack declares no block count."""
    plain = [name for name in STANDALONE_KINDS if name not in STREAMED and name != "generic"]
    assert plain
    for kind in plain:
        assert kinds.get(kind).from_options({}).block_count() is None
