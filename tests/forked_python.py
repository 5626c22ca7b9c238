"""The ``python`` xdist's controller starts each worker of a whole-suite run with.

It runs what xdist asks (``-u -c PROGRAM``) in a process forked from the tests' fork
server, which imported torch once for every worker (``tests.processes.run_forked_python``).
"""

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository: ``tests`` is a package
from tests.processes import run_forked_python  # noqa: E402

if __name__ == "__main__":  # multiprocessing runs this file again, as __mp_main__, in the worker
    sys.exit(run_forked_python(sys.argv[1:]))
