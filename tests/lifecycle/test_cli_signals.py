"""``lifecycle run`` stopped by SIGINT or SIGTERM, in a process of its own."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.processes import Program, start_python

ROOT = Path(__file__).resolve().parents[2]

SPEC = """
name = "signalled"
device = "cpu"

[memory]
offload_target = "disk"
offload_dir = "{offload_dir}"

[components.text_encoder]
kind = "tiny_text_encoder"
residency = "component_offload"

[components.transformer]
kind = "tiny_dit"

[components.vae]
kind = "tiny_vae"
residency = "component_offload"

[[stages]]
name = "encode"
uses = ["text_encoder"]

[[stages]]
name = "denoise"
uses = ["transformer"]

[[stages]]
name = "decode"
uses = ["vae"]
"""


def wait_for_files(folder: Path, program: Program, timeout: float = 90.0) -> None:
    """Return once ``folder`` holds an offload file: the pipeline is loaded and running."""
    deadline = time.monotonic() + timeout
    while not any(folder.glob("*/*")):
        assert program.process.is_alive(), program.stderr()
        assert time.monotonic() < deadline, f"no offload file appeared under {folder}"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"]
)
def test_signal_stops_cleanly(tmp_path: Path, signum: signal.Signals, code: int) -> None:
    """The request in flight finishes, the files go, the summary prints, exit 128 + signal."""
    offload_dir = tmp_path / "offload"
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(offload_dir=offload_dir))
    with start_python(
        "lifecycle", "run", spec, "--requests", "1000000", "--steps", "1", "--threads", "1",
        cwd=ROOT, module=True,
    ) as program:  # fmt: skip
        wait_for_files(offload_dir, program)
        program.send_signal(signum)
        returncode, stdout, stderr = program.wait(timeout=60)
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    assert f"{signum.name} received: finishing the request in flight" in stderr
    assert stdout.startswith("pipeline 'signalled': ")
    assert f"; stopped by {signum.name}\n" in stdout
    assert list(offload_dir.rglob("*")) == []
