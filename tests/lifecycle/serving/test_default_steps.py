"""One default for ``steps`` per pipeline: a request that names none runs the same number of
denoising steps over HTTP, from ``lifecycle run`` and as a ``Batch`` made in Python."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from httpx_sse import connect_sse

from components.batch import Batch
from lifecycle.admission.folder import default_steps
from lifecycle.spec.reading import load_spec
from tests.conftest import Lifecycle
from tests.lifecycle.serving.conftest import ServeSpec

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny_t2i.toml"


class TestDefaultSteps:
    def test_http_the_cli_and_a_batch_agree_on_a_pipeline_of_kinds(
        self, serve_spec: ServeSpec, lifecycle: Lifecycle
    ) -> None:
        """tiny-t2i without ``steps`` steps 4 times over HTTP, from ``run`` and in a Batch."""
        served = serve_spec(load_spec(EXAMPLE))
        body = {"prompt": "a red fox", "seed": 9, "stream": True}
        with (
            served.client() as client,
            connect_sse(client, "POST", "/v1/images/generations", json=body) as source,
        ):
            totals = {sse.json().get("total") for sse in source.iter_sse()} - {None}
        result = lifecycle("run", EXAMPLE, "--requests", "1", "--json")
        assert result.returncode == 0, result.stderr
        ran = json.loads(result.stdout)["summary"]["steps"]
        assert default_steps(None) == 4
        assert (totals, ran, Batch(generator=torch.Generator()).steps) == ({4}, 4, 4)
