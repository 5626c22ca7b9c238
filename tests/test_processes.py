"""What a program forked from the fork server of ``tests.processes`` runs on."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import subprocess
import sys
from pathlib import Path

from tests.processes import SHARED_SERVER, WAIT_POLICY, run_fresh_python, run_python

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


PARENT = "import os\nprint(os.getppid())"

THROUGH_THE_SHARED_SERVER = f"""
import sys
from pathlib import Path

from tests.processes import run_python

print(run_python({PARENT!r}, cwd=Path.cwd()).stdout, end="")
print("torch" in sys.modules)
"""


def test_a_process_given_the_shared_server_forks_its_programs_there(root: Path) -> None:
    """A process started with ``SHARED_SERVER`` naming this process's fork server (as xdist's
    workers are, by their controller) forks its programs from that server, and starts none
    of its own (it never imports torch)."""
    server = int(run_python(PARENT, cwd=root).stdout)
    address = multiprocessing.forkserver._forkserver._forkserver_address
    env = {**os.environ, SHARED_SERVER: address.encode().hex()}
    result = run_fresh_python("-c", THROUGH_THE_SHARED_SERVER, cwd=root, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(server), "False"]


LOADED = """
import gc
import sys

print(sorted(name for name in sys.argv[1:] if name in sys.modules))
print(gc.get_freeze_count() > 10 * len(gc.get_objects()))
"""


def test_a_program_starts_with_the_preloaded_libraries_and_nothing_of_the_project(
    tmp_path: Path,
) -> None:
    """A program starts with what the fork server imported (torch, rich, PyYAML, fastapi,
    uvicorn), and none of the project's packages, structlog or the other extras' libraries,
    which it imports itself; what the server imported is frozen, left out of the program's
    garbage collections."""
    asked = ("torch", "rich.progress", "yaml", "fastapi", "uvicorn", "structlog", "lifecycle")
    asked += ("components", "attention", "benchmarks", "diffusers", "transformers", "tokenizers")
    result = run_python(LOADED, *asked, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "['fastapi', 'rich.progress', 'torch', 'uvicorn', 'yaml']",
        "True",
    ]


WORKER = """
import os
import sys

print(sys.stdin.readline().strip(), os.getcwd(), os.environ["LIFECYCLE_TEST_WORKER"])
print("torch" in sys.modules, os.getppid())
sys.exit(3)
"""


def test_forked_python_runs_what_xdist_runs_in_a_process_forked_from_the_server(
    root: Path, tmp_path: Path
) -> None:
    """``tests/forked_python.py -u -c PROGRAM``, as xdist's controller starts a worker with
    it, runs the program in a process forked from the shared server (torch imported), on
    the caller's stdin and stdout, in its working directory and environment, and exits
    with the program's status."""
    server = int(run_python(PARENT, cwd=root).stdout)
    address = multiprocessing.forkserver._forkserver._forkserver_address
    env = {**os.environ, SHARED_SERVER: address.encode().hex(), "LIFECYCLE_TEST_WORKER": "1"}
    forked = root / "tests" / "forked_python.py"
    done = subprocess.run(
        [sys.executable, forked, "-u", "-c", WORKER],
        input="line\n",
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == [f"line {tmp_path} 1", f"True {server}"]
