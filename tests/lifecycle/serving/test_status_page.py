"""The status page in a real browser: the distribution's Chromium, driven by Playwright.

The page is read through its DOM (states, byte figures, request ids, refusal codes),
never its pixels. Screenshots at desktop and phone width go to the test's folder.
Where no Chromium is installed (``apt-get install chromium-headless-shell``, or
``chromium``), these tests skip.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lifecycle.serving.board import server_sent
from lifecycle.serving.status import QueuedRequest, RunningBatch, StatusSnapshot, worker_status
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.conftest import ReferenceSpec
from tests.lifecycle.serving.conftest import WATCHDOG_S, ServeSpec, loopback_client
from tests.lifecycle.serving.streams import RACE_BUDGET, evicting_spec, snapshot_race

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")

BROWSERS = ("chromium-headless-shell", "chromium")
"""The distribution's Chromium, its headless shell first (no window UI; what Playwright
itself runs headless): the full browser preloads the omnibox's WebUI in every window and
takes about five times the CPU for the same pages."""
CHROMIUM_FLAGS = ["--disable-gpu"]
"""Besides Playwright's own (headless, no sandbox, no background networking, no component
updates, sync or first-run UI)."""
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
TEXT_ENCODER_BYTES = 138_240
"""The tiny text encoder's footprint (its kind's seeded defaults, float32)."""

PIPELINE = 'section[data-pipeline="tiny-t2i"]'

RECORDER = """(selector) => {
  const seen = {states: [], queued: [], used: []};
  const keep = (list, value) => { if (list[list.length - 1] !== value) list.push(value); };
  const record = () => {
    const root = document.querySelector(selector);
    if (!root) return;
    const state = root.querySelector('tr[data-component="text_encoder"] td.state span');
    if (state) keep(seen.states, state.textContent);
    keep(seen.queued, root.querySelectorAll('.queued tbody tr').length);
    const bar = root.querySelector('.bar');
    if (bar.dataset.used !== undefined) keep(seen.used, Number(bar.dataset.used));
  };
  new MutationObserver(record).observe(document, {subtree: true, childList: true,
    attributes: true, characterData: true});
  record();
  window.seenByTest = seen;
}"""
"""Records, after every change of the page, the text encoder's state, the queue's length
and the bytes the budget bar shows (each value once per change); it may run before the
page does (an init script)."""

CUT_CELLS = """(p) => {
  const cut = [];
  for (const cell of document.querySelectorAll(`${p} table :is(th, td)`)) {
    const box = cell.getBoundingClientRect();
    if (!box.width) continue;  // not shown (a phone hides the component table's headings)
    const frame = cell.closest(".scroll, .card").getBoundingClientRect();
    if (cell.scrollWidth > cell.clientWidth || box.left < frame.left || box.right > frame.right)
      cut.push(`${cell.closest("table").className}: ${cell.textContent}`);
  }
  for (const table of document.querySelectorAll(`${p} .scroll > table`)) {
    const scroll = table.parentElement;
    if (scroll.scrollWidth > scroll.clientWidth) cut.push(`${table.className} scrolls`);
  }
  return cut;
}"""
"""Every table cell of a pipeline that is cut at the edge of its card (or of the box it
would scroll in), and every table that has to be scrolled sideways to be read whole."""

IDLE = """(p) => !document.querySelector(`${p} .queued tbody tr, ${p} .running tbody tr`)"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module: launching it costs more CPU than a test's page."""
    chromium = next(filter(None, map(shutil.which, BROWSERS)), None)
    if chromium is None:
        pytest.skip(
            "no Chromium on this machine: `apt-get install chromium-headless-shell` (or "
            "`chromium`) to run the page tests"
        )
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page in a context of its own: no cookies, storage or cache from another test."""
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(WATCHDOG_S * 1000)
    try:
        yield context.new_page()
    finally:
        context.close()


def loaded(snapshot: StatusSnapshot) -> StatusSnapshot:
    """Return ``snapshot`` under load: batches of many long request ids running (one id a
    single 120-character word), long ids queued, and the header's figure of the issue."""
    ids = [f"client-{i}-{'0123456789abcdef' * 2}" for i in range(12)]
    batches = [ids[:6], ids[6:], ["x" * 120]]
    running = tuple(
        RunningBatch(
            id="+".join(batch),
            request_ids=tuple(batch),
            endpoint="images",
            stage="denoise",
            steps=50,
            step=49,
        )
        for batch in batches
    )
    queued = tuple(
        QueuedRequest(id=f"{i}-{'y' * 60}", endpoint="images", items=1, queued_s=1.5, priority=0)
        for i in range(3)
    )
    pipeline = msgspec.structs.replace(snapshot.pipelines[0], running=running, queued=queued)
    return msgspec.structs.replace(snapshot, resident_bytes=735_846, pipelines=(pipeline,))


def generate(url: str, body: dict[str, object]) -> int:
    """Send one image request; return its status."""
    with loopback_client(url) as client:
        return client.post("/v1/images/generations", json=body).status_code


class TestStatusPageInABrowser:
    def test_page_follows_a_run_live(
        self, page: Any, serve_spec: ServeSpec, root: Path, tmp_path: Path
    ) -> None:
        """Under requests that evict, the page shows the text encoder go resident then
        offloaded, the budget bar move within its limit, the queue fill and drain, and a
        refused override with its code and fix; it fits a phone's width."""
        url = serve_spec(load_spec(evicting_spec(root, tmp_path))).url
        page.goto(url + "/")
        page.wait_for_selector('#connection[data-state="live"]')
        page.wait_for_selector(f'{PIPELINE} tr[data-component="text_encoder"]')
        page.evaluate(RECORDER, PIPELINE)
        bodies = [{"prompt": f"a fox {i}", "steps": 4, "seed": i} for i in range(6)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            statuses = list(pool.map(lambda body: generate(url, body), bodies))
        assert statuses == [200] * len(bodies)
        assert generate(url, {"prompt": "a fox", "attention_backend": "sliding_window"}) == 400
        refusal = page.wait_for_selector(
            f'{PIPELINE} .refusal-list li[data-code="attention.invalid_override"]'
        )
        page.wait_for_function(IDLE, arg=PIPELINE)
        seen = page.evaluate("window.seenByTest")
        row = page.locator(f'{PIPELINE} tr[data-component="text_encoder"]')
        footprint = row.locator("td.bytes").get_attribute("data-footprint")
        bar = page.locator(f"{PIPELINE} .bar")
        limit = bar.get_attribute("data-limit")
        figures = page.locator(f"{PIPELINE} .figures").inner_text()
        occupied = page.locator(f"{PIPELINE} .diagram .state.occupied").evaluate_all(
            "nodes => nodes.map(n => n.dataset.state)"
        )
        page.screenshot(path=tmp_path / "status-1280x800.png", full_page=True)
        page.set_viewport_size(PHONE)
        page_width = page.evaluate("document.documentElement.scrollWidth")
        page.screenshot(path=tmp_path / "status-390x844.png", full_page=True)
        refusal_text = refusal.inner_text()
        first_resident = seen["states"].index("resident")
        assert "offloaded" in seen["states"][first_resident:]
        assert max(seen["queued"]) >= 1
        assert seen["queued"][-1] == 0
        assert max(seen["used"]) > 0
        assert all(used <= 300_000 for used in seen["used"])
        assert footprint == str(TEXT_ENCODER_BYTES)
        assert limit == "300000"
        assert "of a 293.0 KiB budget" in figures
        assert "offloaded" in occupied
        assert "attention.invalid_override" in refusal_text
        assert "fix: name a backend" in refusal_text
        assert page_width <= PHONE["width"]  # the diagram scrolls in its card, not the page
        for name in ("status-1280x800.png", "status-390x844.png"):
            assert (tmp_path / name).stat().st_size > 10_000

    def test_page_skips_moves_its_snapshot_already_shows(
        self, page: Any, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """Fed the stream's race (a snapshot read past moves still on their way), the page
        never shows the text encoder's older onload beside the VAE: the bar stays within
        the budget, shows the racing snapshot, then the VAE's later offload."""
        served = serve_spec(t2i_spec(memory={"device_budget": RACE_BUDGET}))
        with ThreadPoolExecutor(1) as pool:  # Playwright's sync API runs a loop on this thread
            sent = pool.submit(snapshot_race, served.worker).result()
        stream = b"retry: 3600000\n\n" + b"".join(sent)  # once: no reconnect in the test
        page.route(
            "**/v1/events",
            lambda route: route.fulfill(
                status=200, headers={"content-type": "text/event-stream"}, body=stream
            ),
        )
        page.add_init_script(f"({RECORDER})({json.dumps(PIPELINE)})")
        page.goto(served.url + "/")
        page.wait_for_selector('#connection[data-state="lost"]')  # the stream was read whole
        seen = page.evaluate("window.seenByTest")
        resident = [
            snapshot["pipelines"][0]["resident_bytes"]
            for snapshot in map(json.loads, (m.removeprefix(b"data: ") for m in sent))
            if snapshot.get("type") == "status.snapshot"
        ]
        assert max(seen["used"]) <= RACE_BUDGET
        assert resident[1] in seen["used"]  # the racing snapshot: the VAE beside the transformer
        assert seen["used"][-1] == resident[-1]

    def test_header_and_tables_read_whole_under_load_at_any_width(
        self,
        page: Any,
        serve_spec: ServeSpec,
        t2i_spec: Callable[..., PipelineSpec],
        tmp_path: Path,
    ) -> None:
        """With no device budget the header and the budget card say so after a comma; under
        load every table fits its card at desktop and phone width, no cell cut, and each
        running batch shows its whole id beside its stage and step."""
        served = serve_spec(t2i_spec())
        snapshot = loaded(worker_status(served.worker))
        stream = b"retry: 3600000\n\n" + server_sent(msgspec.json.encode(snapshot))
        page.route(
            "**/v1/events",
            lambda route: route.fulfill(
                status=200, headers={"content-type": "text/event-stream"}, body=stream
            ),
        )
        page.goto(served.url + "/")
        page.wait_for_selector('#connection[data-state="lost"]')  # the stream was read whole
        header = page.locator("#worker").inner_text()
        figures = page.locator(f"{PIPELINE} .figures").inner_text()
        cut = {"desktop": page.evaluate(CUT_CELLS, PIPELINE)}
        page.screenshot(path=tmp_path / "loaded-1280x800.png", full_page=True)
        page.set_viewport_size(PHONE)
        cut["phone"] = page.evaluate(CUT_CELLS, PIPELINE)
        page.screenshot(path=tmp_path / "loaded-390x844.png", full_page=True)
        page_width = page.evaluate("document.documentElement.scrollWidth")
        rows = page.locator(f"{PIPELINE} .running tbody tr").evaluate_all(
            "rows => rows.map(r => [r.dataset.batchId, ...[...r.cells].map(c => c.innerText)])"
        )
        assert header == "ready: 1 pipeline, 718.6 KiB on the device, no device budget"
        assert figures.endswith(" on the device, no device budget")
        assert cut == {"desktop": [], "phone": []}
        assert page_width <= PHONE["width"]
        assert [[row[0], "".join(row[1].split()), *row[2:]] for row in rows] == [
            [batch.id, batch.id, "denoise", "49 / 50"] for batch in snapshot.pipelines[0].running
        ]

    def test_components_show_their_acceleration_and_quantized_bytes(
        self, page: Any, serve_spec: ServeSpec, reference_spec: ReferenceSpec
    ) -> None:
        """The components table says int8_weight_only on a quantized transformer and a dash
        on the others, gives its quantized bytes as its footprint, and still fits a phone."""
        pytest.importorskip("torchao")
        served = serve_spec(reference_spec(transformer={"quantization": "int8_weight_only"}))
        page.goto(served.url + "/")
        page.wait_for_selector(f'{PIPELINE} tr[data-component="transformer"] td.acceleration')
        cells = page.locator(f"{PIPELINE} td.acceleration").evaluate_all(
            "cells => cells.map(c => [c.closest('tr').dataset.component, c.textContent])"
        )
        row = page.locator(f'{PIPELINE} tr[data-component="transformer"]')
        footprint = row.locator("td.bytes").get_attribute("data-footprint")
        page.set_viewport_size(PHONE)
        cut = page.evaluate(CUT_CELLS, PIPELINE)
        planned = served.worker.orchestrator.snapshot().components["transformer"].bytes
        assert dict(cells) == {
            "text_encoder": "\u2014",
            "transformer": "int8_weight_only",
            "vae": "\u2014",
        }
        assert footprint == str(planned)
        assert cut == []
