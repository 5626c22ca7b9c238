"""What a fresh ``lifecycle`` process imports: a layout's sharding machinery only if it splits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_t2i.toml"

SHARDING = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.run")
"""What only a splitting layout (or ``--nproc``) needs; importing one costs ~0.03-1 CPU-s."""

# the CLI's entry module, then the command, in the process; what it imported goes last
CHECK = f"""
import sys
from lifecycle.cli import main
code = main(["check", sys.argv[1]])
print(code, sorted(name for name in {SHARDING!r} if name in sys.modules))
"""


class TestFreshProcess:
    def test_check_without_a_layout_imports_no_sharding(self) -> None:
        """``lifecycle check`` of a one-process spec imports no FSDP, DTensor or torchrun."""
        # a fresh interpreter: the fork server of tests/processes.py preloads these modules
        result = subprocess.run(
            [sys.executable, "-c", CHECK, str(EXAMPLE)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-1] == "0 []"
