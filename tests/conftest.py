"""Markers and fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attention import Platform
from benchmarks.make_pipeline import Family, write_pipeline


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


class PipelineFolders:
    """Tiny diffusers-format pipeline folders, each written once per test run when first asked.

    Args:
        root: where the folders are written.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: dict[str, Path] = {}

    def __call__(self, family: Family) -> Path:
        """Return the tiny folder of ``family``."""
        if family not in self.written:
            self.written[family] = write_pipeline(family, self.root / family)
        return self.written[family]


@pytest.fixture(scope="session")
def pipeline_folder(tmp_path_factory: pytest.TempPathFactory) -> PipelineFolders:
    """Write tiny pipeline folders with seeded weights (``benchmarks.make_pipeline``) on demand.

    Skips where the ``diffusers`` extra is not installed: the folders are written by
    diffusers' and transformers' own classes.
    """
    from components.libraries import is_importable

    for library in ("diffusers", "transformers", "tokenizers"):
        if not is_importable(library):
            pytest.skip(f"{library} is not installed: pip install 'pipeline-lifecycle[diffusers]'")
    return PipelineFolders(tmp_path_factory.mktemp("pipelines"))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test with one torch thread: tiny models run faster alone on a shared machine.

    (Two OpenMP threads on a busy 2-core machine spin against each other: a tiny
    pipeline request measured 0.3 s with one thread and 4 s with two.)
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
