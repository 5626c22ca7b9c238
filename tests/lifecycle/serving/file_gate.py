"""The ``file_gated`` backend: requests of a ``lifecycle serve`` process wait at a gate of files.

The in-process tests hold requests at the ``gated`` backend (``conftest.GATE``); a served
process of its own cannot share its events, so its kernel waits on files instead. The
process installs the backend from entry points, as it would an installed package's
(``FileGate.path``), and finds the gate folder in ``LIFECYCLE_TEST_GATE``. A request held
so takes no CPU, however long a loaded machine takes to signal the process and send the
next requests; a request of many steps instead could end first.

The served process imports this module: it imports nothing of pytest or the fixtures.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from attention.backends.torch_flash import TorchFlashBackend, TorchFlashImpl
from tests.plugin.installed import dist_info

GATE_ENV = "LIFECYCLE_TEST_GATE"
"""The environment variable that names the gate folder to a served process."""
POLL_S = 0.02
"""How often a held kernel, or a test waiting for one, looks at the gate folder."""
ROOT = Path(__file__).resolve().parents[3]
"""The repository, where this module lies on a served process's path."""


class FileGatedImpl(TorchFlashImpl):
    """torch_flash's kernel, which first waits at the gate folder."""

    def forward_with_lse(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``reached``, wait until ``open`` exists, then attend as torch_flash does.

        Every unmasked call passes here: plain, causal, and each packed sequence.
        """
        folder = Path(os.environ[GATE_ENV])
        (folder / "reached").touch()
        while not (folder / "open").exists():
            time.sleep(POLL_S)
        return super().forward_with_lse(*args, **kwargs)


class FileGatedBackend(TorchFlashBackend):
    """An out-of-tree backend whose requests stay in flight until the test opens the gate."""

    name: ClassVar[str] = "file_gated"  # type: ignore[misc]
    impl_cls = FileGatedImpl


class FileGate:
    """The gate of served processes: requests on ``file_gated`` wait until ``open``.

    Attributes:
        folder: the gate folder (``LIFECYCLE_TEST_GATE``).
        path: the ``sys.path`` entries that install ``file_gated`` in a served process:
            the distribution's folder, and the repository where this module lies.

    Args:
        folder: the test's folder; the gate and the distribution go in it.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder / "gate"
        self.folder.mkdir()
        site = folder / "site"
        entry = f"[pipeline_lifecycle.backends]\nfile_gated = {__name__}:FileGatedBackend\n"
        dist_info(site, "lifecycle-file-gate", entry)
        self.path = (site, ROOT)

    def reached(self, timeout: float) -> bool:
        """Return whether a request reached the kernel within ``timeout`` seconds."""
        for _ in range(int(timeout / POLL_S)):
            if (self.folder / "reached").exists():
                return True
            time.sleep(POLL_S)
        return False

    def open(self) -> None:
        """Let every held request, and every later one, through."""
        (self.folder / "open").touch()
