"""What a program forked from the fork server of ``tests.processes`` runs on."""

from __future__ import annotations

import os
from pathlib import Path

from tests.processes import WAIT_POLICY, run_python

SERVER_AND_OWN = """
import os
from pathlib import Path

server = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\\0")
name = "OMP_WAIT_POLICY"
print([entry.decode() for entry in server if entry.startswith(name.encode() + b"=")])
print(os.environ.get(name))
"""


def test_programs_compute_on_openmp_started_as_a_lifecycle_process_starts_it(
    tmp_path: Path,
) -> None:
    """The fork server, whose OpenMP runtime the programs run on, started with the wait
    policy a ``lifecycle`` process sets (passive) where the environment chose none; each
    program's own environment is the test's."""
    name, policy = WAIT_POLICY
    result = run_python(SERVER_AND_OWN, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        str([f"{name}={os.environ.get(name, policy)}"]),
        str(os.environ.get(name)),
    ]
