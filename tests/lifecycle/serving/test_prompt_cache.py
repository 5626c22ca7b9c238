"""The prompt cache in a worker: ``/metrics`` counts the prompts it gave and those encoded."""

from __future__ import annotations

import pytest

from tests.conftest import PipelineFolders
from tests.lifecycle.folder_specs import REQUESTS
from tests.lifecycle.serving.conftest import ServeSpec
from tests.lifecycle.serving.test_folders import body_of, generate, pngs
from tests.lifecycle.test_prompt_cache import cached_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_metrics_count_hits(pipeline_folder: PipelineFolders, serve_spec: ServeSpec) -> None:
    """The worker counts each prompt the cache gave and each it encoded, by pipeline."""
    spec = cached_spec(pipeline_folder("flux2-klein"))
    served = serve_spec(spec)
    body = body_of(REQUESTS["flux2-klein"])
    with served.client() as client:
        for _ in range(2):
            pngs(generate(client, **body))
        metrics = client.get("/metrics").text
    name = spec.name
    assert f'lifecycle_prompt_cache_rows_total{{outcome="hit",pipeline="{name}"}} 1.0' in metrics
    # the warm-up request's prompt and the first request's were encoded
    assert f'lifecycle_prompt_cache_rows_total{{outcome="miss",pipeline="{name}"}} 2.0' in metrics
