"""Markers and fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attention import Platform


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``cuda`` tests where no CUDA device is present (they run where a GPU is lent)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def root() -> Path:
    """The repository root: examples, diagrams and the README are found from here."""
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cpu() -> Platform:
    """A CPU platform built explicitly, so selection does not depend on this machine."""
    return Platform("cpu")


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    """Seed torch's global generator before each test, so implicit draws (layer init) repeat."""
    torch.manual_seed(0)
