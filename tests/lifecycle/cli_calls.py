"""Several ``lifecycle`` calls in one process of their own, each one's output kept apart.

A test that needs a process of its own (one without a library, one offline on a cache)
pays for the process and its imports once, not once per call.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.processes import Finished, run_python

CALLS = """
import contextlib, io, json, os, sys
from lifecycle.cli.entry import main

answers = []
for cwd, argv in json.loads(sys.argv[1]):
    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    answers.append((code, out.getvalue(), err.getvalue()))
print(json.dumps(answers))
"""
"""A program that runs ``lifecycle`` for each ``(cwd, argv)`` of its argument (JSON) in
turn, each in its folder, and prints each one's exit code, stdout and stderr (JSON)."""


def lifecycle_calls(calls: list[tuple[Path, list[str]]], before: str = "") -> list[Finished]:
    """Run ``lifecycle`` for each ``(cwd, argv)`` of ``calls`` in turn, in one process of its
    own (``before`` runs first); return what each call left."""
    encoded = json.dumps([(str(cwd), argv) for cwd, argv in calls])
    result = run_python(before + CALLS, encoded, cwd=calls[0][0])
    assert result.returncode == 0, result.stderr
    return [Finished(*answer) for answer in json.loads(result.stdout)]
