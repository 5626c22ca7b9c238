"""Fixtures shared by the attention tests."""

from __future__ import annotations

import random

import pytest

from attention import Platform
from attention.testing import RandomInputs


@pytest.fixture
def inputs() -> RandomInputs:
    """Fresh random inputs; assertions quote ``inputs.seed`` to reproduce a failure."""
    return RandomInputs(random.SystemRandom().randrange(2**31))


@pytest.fixture
def cpu() -> Platform:
    """A CPU platform built explicitly, so selection does not depend on this machine."""
    return Platform("cpu")
