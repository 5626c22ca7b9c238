"""Fixtures shared by the attention tests."""

from __future__ import annotations

import pytest

from attention.testing import RandomInputs

INPUT_SEED = 0


@pytest.fixture
def inputs() -> RandomInputs:
    """Random inputs from a fixed seed, so every run draws the same values."""
    return RandomInputs(INPUT_SEED)
