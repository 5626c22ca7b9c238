"""File options of a kind (``weights``, a tokenizer) are read from the spec file's folder,
as ``source`` and adapter files are, whatever the working directory."""

from __future__ import annotations

from pathlib import Path

from lifecycle.cli.exits import ExitCode
from lifecycle.spec.reading import decode_spec
from tests.processes import run_python

SPEC = """
name = "files"
device = "cpu"

[components.vae]
kind = "tiny_vae"
options = { weights = "weights/vae.safetensors" }

[components.text_encoder]
kind = "minilm_text_encoder"
options = { tokenizer = "tok/tokenizer.json", weights = "/abs/minilm.safetensors" }

[[stages]]
name = "decode"
uses = ["vae", "text_encoder"]
"""


class TestOptionFiles:
    def test_relative_file_options_are_read_from_the_spec_folder(self, tmp_path: Path) -> None:
        """A relative ``weights`` or ``tokenizer`` option becomes a path under the spec's
        folder; an absolute one and the other options stay as written."""
        spec = decode_spec(SPEC, base=tmp_path)
        assert spec.components["vae"].options == {
            "weights": str(tmp_path / "weights" / "vae.safetensors")
        }
        assert spec.components["text_encoder"].options == {
            "tokenizer": str(tmp_path / "tok" / "tokenizer.json"),
            "weights": "/abs/minilm.safetensors",
        }

    def test_check_reads_weights_beside_the_spec_from_anywhere(
        self, root: Path, tmp_path: Path
    ) -> None:
        """``check`` of the weights-mismatch example, run from another folder, reads the
        weights file beside the spec and refuses it for its shapes, not as missing."""
        spec = root / "examples" / "refused" / "weights_mismatch.toml"
        done = run_python("lifecycle", "check", spec, cwd=tmp_path, module=True)
        assert done.returncode == ExitCode.REFUSED, done.stdout + done.stderr
        assert "loader.weights_mismatch" in done.stdout
        assert "loader.unavailable" not in done.stdout
