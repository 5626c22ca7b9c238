"""``POST /v1/pipelines`` with a model id: a worker of its own reads it from the Hugging Face
cache, offline, with and without a revision."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch

from tests.components.folder_runs import run_diffusers
from tests.conftest import PipelineFolders, decode_png
from tests.hub_layout import cache_repo, commit_of
from tests.lifecycle.folder_specs import REQUESTS, assert_same_pixels, pixels
from tests.lifecycle.serving.command import serving
from tests.lifecycle.serving.conftest import loopback_client
from tests.lifecycle.serving.test_folders import body_of

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = "tiny-org/pixart"
ADMIN_KEY = "sk-admin-model-ids"


def test_post_a_model_id_with_and_without_a_revision(
    pipeline_folder: PipelineFolders,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """POST /v1/pipelines with ``ORG/NAME`` serves the cache's ``main`` (named NAME); with
    ``@BRANCH`` it swaps in that revision; each makes diffusers' image of its folder; an id
    the cache lacks is a 400 naming the cache and ``--download``."""
    alpha, sigma = pipeline_folder("pixart"), pipeline_folder("pixart-sigma")
    cache = tmp_path / "hf-cache"
    cache_repo(cache, REPO, alpha, commit_of("main"))
    cache_repo(cache, REPO, sigma, commit_of("sigma"), {"sigma": commit_of("sigma")})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    images, actions = {}, []
    with (
        serving(sigma, "--admin-key", ADMIN_KEY) as (_, url),
        loopback_client(url, headers=headers) as client,
    ):
        for path, family in ((REPO, "pixart"), (f"{REPO}@sigma", "pixart-sigma")):
            added = client.post("/v1/pipelines", json={"path": path})
            assert added.status_code in (200, 201), added.text
            actions.append(added.json()["action"])
            body = {**body_of(REQUESTS[family]), "model": "pixart"}
            answer = client.post("/v1/images/generations", json=body)
            assert answer.status_code == 200, answer.text
            images[family] = base64.b64decode(answer.json()["data"][0]["b64_json"])
        missing = client.post("/v1/pipelines", json={"path": "tiny-org/absent"})
        names = sorted(p["name"] for p in client.get("/v1/pipelines").json()["data"])
    assert actions == ["added", "swapped"]
    assert names == ["pixart", "pixart-sigma"]
    assert missing.status_code == 400
    message = missing.json()["error"]["message"]
    assert f"is not in the Hugging Face cache {cache}; download it with --download" in message
    for family, png in images.items():
        theirs: torch.Tensor = run_diffusers(pipeline_folder(family), REQUESTS[family])
        assert_same_pixels(decode_png(png), pixels(theirs)[0])
