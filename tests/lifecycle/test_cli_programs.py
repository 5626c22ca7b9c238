"""The tests' programs in processes of their own (``tests.processes``) end as a new
interpreter ends them."""

from __future__ import annotations

from pathlib import Path

from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]

EXITING = """
import atexit, weakref

class Made:
    pass

made = Made()
weakref.finalize(made, print, "the program's finalizer")
atexit.register(print, "the program's exit handler")
others = [f for f in weakref.finalize._registry if f.atexit and f.peek()[0] is not made]
print("other finalizers to run at exit:", len(others))
"""


def test_a_program_finalizes_at_exit_only_what_it_made() -> None:
    """At exit a program runs its own handlers, then its finalizers, as Python does; the
    objects the fork server made (torch's operator libraries) are not finalized in it."""
    result = run_python(EXITING, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "other finalizers to run at exit: 0",
        "the program's exit handler",
        "the program's finalizer",
    ]
