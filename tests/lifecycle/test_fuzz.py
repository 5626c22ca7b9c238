"""Mutated specs in TOML, JSON and YAML through the CLI: exit codes, JSON, no traceback.

The default profile runs 600 fixed (derandomized) cases, about 15 seconds here;
``make fuzz`` runs the long one (``LIFECYCLE_FUZZ=long``: 5,000 fresh cases). Inputs that
once broke a property, and the issue's reproductions, live in ``fuzz_corpus/`` and run
every time; copy a new failure there, in the format it was found in.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.lifecycle.fuzzing import lifecycle, place_offload, spec_texts, world_size

pytestmark = pytest.mark.long

CORPUS = sorted((Path(__file__).parent / "fuzz_corpus").iterdir())
PROFILES = {"default": 600, "long": 5000}
EXAMPLES = PROFILES[os.environ.get("LIFECYCLE_FUZZ", "default")]


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """A folder for the spec files and offload folders of this module."""
    with tempfile.TemporaryDirectory(prefix="lifecycle-fuzz-") as folder:
        yield Path(folder)


def check_properties(text: str, fmt: str, folder: Path, run_it: bool) -> None:
    """Hold ``check`` (and, when admitted and ``run_it``, ``run``) to the CLI's promises."""
    path = folder / f"spec.{fmt}"
    # a new file each time: overwriting one in place makes ext4 write it out at close
    # (auto_da_alloc), a millisecond or more each of 600 examples on a busy disk
    path.unlink(missing_ok=True)
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    checked = lifecycle("check", "--json", str(path))
    assert checked.code in (0, 1, 2), checked
    assert "Traceback" not in checked.stderr
    report = json.loads(checked.stdout)
    assert isinstance(report, dict)
    assert ("error" in report) == (checked.code == 2)
    plain = lifecycle("check", str(path))
    assert plain.code == checked.code
    assert "Traceback" not in plain.stderr
    if checked.code == 0 and run_it and world_size(text, fmt) == 1:
        # a layout of several processes is admitted and refused at launch: the
        # parallel-execution issue covers it
        path.unlink()
        path.write_text(place_offload(text, fmt, folder / "offload"), encoding="utf-8")
        ran = lifecycle("run", str(path), "--requests", "1", "--steps", "1")
        assert ran.code == 0, ran.stderr
        assert "Traceback" not in ran.stderr


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("LIFECYCLE_FUZZ") != "long",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=spec_texts(), run_it=st.integers(0, 9).map(lambda n: n == 0))
def test_mutated_specs_keep_the_promises(
    spec: tuple[str, str], run_it: bool, workdir: Path
) -> None:
    """Any mutated spec is checked with exit 0, 1 or 2, one JSON object, no traceback."""
    fmt, text = spec
    check_properties(text, fmt, workdir, run_it)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_corpus(path: Path, workdir: Path) -> None:
    """Each input that once broke a promise keeps it now, and runs when admitted."""
    fmt = path.suffix.lstrip(".")
    check_properties(path.read_text(encoding="utf-8"), fmt, workdir, run_it=True)
