"""``/metrics`` counts what the orchestrator observed, whatever the log level."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lifecycle.logs import configure_logging
from lifecycle.refusals import TransitionRefused
from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.serving.conftest import WATCHDOG_S, Served, ServeSpec
from tests.lifecycle.test_waiting import until

BUDGET = 249_588
"""The VAE (248,588 B) and a little: the text encoder does not fit beside the transformer."""

COUNTED = re.compile(
    r"^(lifecycle_(transitions|moved_bytes|refusals)_total"
    r"|lifecycle_(memory_wait|pipeline_request)_seconds_count)(\{.*\})? (\S+)$"
)
"""The samples that count moves, transitions, refusals, waits and requests (not durations)."""


def counted(metrics: str) -> dict[str, float]:
    """Return each counting sample of a Prometheus text, by name and labels."""
    found = {}
    for line in metrics.splitlines():
        match = COUNTED.match(line)
        if match:
            found[match.group(1) + (match.group(4) or "")] = float(match.group(5))
    return found


def wait_and_refusals(served: Served) -> dict[str, float]:
    """Run one request that waits for memory, meet two refusals; return the counted samples.

    The test holds the transformer through the embedded API while an HTTP request
    needs the text encoder beside it: that request waits, deterministically, until
    the test lets go. A manual offload of the held transformer and an unknown
    backend override are refused.
    """
    orchestrator = served.worker.orchestrator

    def generate(**body: object) -> httpx.Response:
        with served.client() as client:
            return client.post("/v1/images/generations", json={"prompt": "a fox", **body})

    assert generate(steps=1, attention_backend="flash_attn_9").status_code == 400
    with ThreadPoolExecutor(1) as pool:
        with orchestrator.request("holder") as holder, holder.stage("denoise"):
            with pytest.raises(TransitionRefused):
                orchestrator.offload("transformer")
            waiting = pool.submit(generate, steps=1)
            until(lambda: len(orchestrator.waiter.queue) == 1)
        assert waiting.result(timeout=WATCHDOG_S).status_code == 200
    return counted(served.get("/metrics").text)


def test_counts_do_not_depend_on_the_log_level(
    serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
) -> None:
    """Moves, transitions, waits, refusals and requests count the same at warning as at info."""
    samples: dict[str, dict[str, float]] = {}
    logged: dict[str, list[str]] = {}
    for level in ("warning", "info"):
        stream = io.StringIO()
        configure_logging("json", level, stream)  # process_state puts the logging back
        served = serve_spec(t2i_spec(memory={"device_budget": BUDGET}, batch_window_ms=0))
        samples[level] = wait_and_refusals(served)
        logged[level] = [json.loads(line)["event"] for line in stream.getvalue().splitlines()]
    assert "lifecycle.transition" not in logged["warning"]  # the level the user chose
    assert "residency.waited" in logged["info"]
    assert samples["warning"] == samples["info"]
    counts = samples["warning"]
    assert counts['lifecycle_memory_wait_seconds_count{outcome="acquired"}'] == 1
    assert counts['lifecycle_refusals_total{code="residency.in_use"}'] == 1
    assert counts['lifecycle_refusals_total{code="attention.invalid_override"}'] == 1
    assert counts['lifecycle_transitions_total{trigger="onload"}'] > 0
    assert counts['lifecycle_moved_bytes_total{direction="offload"}'] > 0
    assert counts["lifecycle_pipeline_request_seconds_count"] >= 2  # the holder's and the HTTP one
