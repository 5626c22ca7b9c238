"""Adapters over HTTP: ``/v1/adapters`` and a request's ``lora`` field (design §14)."""

from __future__ import annotations

import base64
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch

from benchmarks.make_adapter import write_lora
from lifecycle.serving.auth import DoorKeys, Secret
from lifecycle.serving.jobs import BatchKey, Job
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import PipelineSpec
from tests.conftest import decode_png
from tests.lifecycle.conftest import ReferenceSpec
from tests.lifecycle.serving.conftest import Served, ServeSpec, run_alone
from tests.lifecycle.test_adapters import linear_shapes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lora_spec(reference_spec: ReferenceSpec, tmp_path: Path) -> PipelineSpec:
    """The reference spec with a merged and an unmerged LoRA of the DiT's MLPs."""
    path = write_lora(
        linear_shapes("tiny_dit", contains="mlp"),
        tmp_path / "mlp.safetensors",
        prefix="transformer",
    )
    raw = msgspec.to_builtins(reference_spec())
    raw["adapters"] = {
        "mlp": {"path": str(path), "scale": 0.5},
        "mlp_u": {"path": str(path), "mode": "unmerged"},
    }
    return decode_spec(msgspec.json.encode(raw).decode(), "json")


ADMIN_KEY = "sk-admin-adapters"
ADMIN = DoorKeys(admin=Secret(ADMIN_KEY))
"""The keys of a worker whose adapter routes are open (they are admin routes)."""


def with_admin_key(served: Served) -> Served:
    """Make every client of ``served`` send the admin key."""
    served.headers["authorization"] = f"Bearer {ADMIN_KEY}"
    return served


def generate(client: httpx.Client, **body: Any) -> httpx.Response:
    """Ask for one image of two steps with seed 3 (``body`` adds fields)."""
    return client.post(
        "/v1/images/generations", json={"prompt": "a red fox", "steps": 2, "seed": 3, **body}
    )


def pixels(response: httpx.Response) -> torch.Tensor:
    """Return the first image of an answer, decoded."""
    return decode_png(base64.b64decode(response.json()["data"][0]["b64_json"]))


def expected(served: Any, adapters: tuple[tuple[str, float], ...]) -> torch.Tensor:
    """Return the image the embedded API makes with ``adapters``, as the PNG holds it."""
    key = BatchKey(endpoint="images", steps=2, latent_size=(4, 4), adapters=adapters)
    job = Job(id=f"alone{adapters}", key=key, prompts=["a red fox"], tokens=16, seed=3)
    image = run_alone(served.worker, job)[0]
    return ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0)


class TestAdaptersOverHttp:
    def test_listed(self, serve_spec: ServeSpec, lora_spec: PipelineSpec) -> None:
        """GET /v1/adapters lists each adapter with its pipeline, component, state, mode, scale."""
        served = serve_spec(lora_spec)
        with served.client() as client:
            listed = client.get("/v1/adapters").json()
        assert [
            (a["pipeline"], a["name"], a["component"], a["state"], a["mode"], a["scale"])
            for a in listed["data"]
        ] == [
            ("tiny-t2i", "mlp", "transformer", "loaded", "merged", 0.5),
            ("tiny-t2i", "mlp_u", "transformer", "active", "unmerged", 1.0),
        ]

    def test_each_adapter_counts_its_switches(
        self, serve_spec: ServeSpec, lora_spec: PipelineSpec
    ) -> None:
        """Each listed adapter carries its own ``switches`` and ``merged_scale`` (design §14);
        the answer holds ``data`` only."""
        served = serve_spec(lora_spec)
        with served.client() as client:
            assert generate(client, lora={"mlp": None}).status_code == 200  # merged in
            merged = client.get("/v1/adapters").json()
            assert generate(client).status_code == 200  # the base again: taken out
            listed = client.get("/v1/adapters").json()
        assert list(listed) == ["data"]
        rows = [(a["name"], a["merged_scale"], a["switches"]) for a in merged["data"]]
        assert rows == [("mlp", 0.5, 1), ("mlp_u", None, 0)]
        rows = [(a["name"], a["merged_scale"], a["switches"]) for a in listed["data"]]
        assert rows == [("mlp", None, 2), ("mlp_u", None, 0)]
        assert {a["path"] for a in listed["data"]} == {lora_spec.adapters["mlp"].path}

    def test_unknown_adapter_is_400_listing_the_known(
        self, serve_spec: ServeSpec, lora_spec: PipelineSpec
    ) -> None:
        """A request naming an unknown adapter is a 400 naming the field and the known ones."""
        served = serve_spec(lora_spec)
        with served.client() as client:
            response = generate(client, lora={"nope": 1.0})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("lora", "unknown_adapter")
        assert "known adapters: mlp, mlp_u" in error["message"]

    def test_concurrent_sets_each_equal_alone(
        self, serve_spec: ServeSpec, lora_spec: PipelineSpec
    ) -> None:
        """Concurrent requests with different sets each get the image of their set alone."""
        served = serve_spec(lora_spec)
        bodies: list[dict[str, Any]] = [{}, {"lora": {"mlp": None}}, {"lora": {"mlp_u": 0.5}}] * 3

        def send(body: dict[str, Any]) -> httpx.Response:
            with served.client() as client:
                return generate(client, **body)

        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(send, bodies))
        assert [r.status_code for r in responses] == [200] * len(bodies)
        want = {
            "": expected(served, ()),
            "mlp": expected(served, (("mlp", 0.5),)),
            "mlp_u": expected(served, (("mlp_u", 0.5),)),
        }
        for body, response in zip(bodies, responses, strict=True):
            name = next(iter(body.get("lora", {"": 0})))
            assert (pixels(response).int() - want[name].int()).abs().max() <= 1, name
        assert not torch.equal(want[""], want["mlp"])
        assert (want["mlp"].int() - want["mlp_u"].int()).abs().max() <= 1

    def test_add_and_remove(self, serve_spec: ServeSpec, lora_spec: PipelineSpec) -> None:
        """POST adds an adapter requests may name at once; DELETE removes it (then 404)."""
        served = with_admin_key(serve_spec(lora_spec, ADMIN))
        path = lora_spec.adapters["mlp"].path
        with served.client() as client:
            added = client.post("/v1/adapters", json={"name": "late", "path": path, "scale": 0.5})
            assert added.status_code == 200, added.text
            assert added.json()["state"] == "loaded"
            late = generate(client, lora={"late": None})
            assert torch.equal(pixels(late), pixels(generate(client, lora={"mlp": None})))
            assert client.delete("/v1/adapters/late").status_code == 200
            assert "late" not in [a["name"] for a in client.get("/v1/adapters").json()["data"]]
            assert generate(client, lora={"late": None}).status_code == 400
            assert client.delete("/v1/adapters/late").status_code == 404

    def test_added_path_is_read_from_the_working_directory(
        self,
        serve_spec: ServeSpec,
        lora_spec: PipelineSpec,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """POST reads a relative path from the worker's working directory (a file on its
        disk, as POST /v1/pipelines takes one); a missing file is a 400 naming ``path``."""
        served = with_admin_key(serve_spec(lora_spec, ADMIN))
        shutil.copy(lora_spec.adapters["mlp"].path, tmp_path / "late.safetensors")
        monkeypatch.chdir(tmp_path)
        with served.client() as client:
            added = client.post("/v1/adapters", json={"name": "late", "path": "late.safetensors"})
            missing = client.post("/v1/adapters", json={"name": "gone", "path": "gone.safetensors"})
        assert added.status_code == 200, added.text
        assert added.json()["path"] == str(tmp_path.resolve() / "late.safetensors")
        assert missing.status_code == 400
        error = missing.json()["error"]
        assert (error["param"], error["code"]) == ("path", "adapter_file_missing")
        assert error["message"] == (
            "Expected a LoRA safetensors file, got 'gone.safetensors': no file at "
            f"{tmp_path.resolve() / 'gone.safetensors'}; a relative path is read from the "
            "worker's working directory"
        )

    def test_names_and_paths_no_spec_could_hold_are_400s(
        self, serve_spec: ServeSpec, lora_spec: PipelineSpec
    ) -> None:
        """A name a spec could not give an adapter and a path longer than any file system
        names are 400s at their field, answered in a few hundred bytes; a file name too
        long for the file system is a 400 too (it was a 500)."""
        served = with_admin_key(serve_spec(lora_spec, ADMIN))
        path = lora_spec.adapters["mlp"].path
        long_name = "x" * 300  # one path component over NAME_MAX (255)
        bodies = {
            ("name", 400): {"name": "a" * 20_000, "path": path},
            ("name", 400, "space"): {"name": "a b", "path": path},
            ("path", 400): {"name": "late", "path": "p" * 20_000},
            ("path", 400, "component"): {"name": "late", "path": long_name + ".safetensors"},
        }
        with served.client() as client:
            answers = {key: client.post("/v1/adapters", json=body) for key, body in bodies.items()}
        for (field, status, *_), answer in answers.items():
            assert answer.status_code == status, answer.text
            assert answer.json()["error"]["param"] == field
            assert len(answer.content) < 1_000

    def test_refused_add_is_409_with_the_refusal(
        self, serve_spec: ServeSpec, lora_spec: PipelineSpec, tmp_path: Path
    ) -> None:
        """An adapter that does not fit is a 409 carrying adapter.target_mismatch."""
        served = with_admin_key(serve_spec(lora_spec, ADMIN))
        bad = write_lora(
            {"blocks.0.mlp.0": (64, 16)}, tmp_path / "bad.safetensors", prefix="transformer"
        )
        with served.client() as client:
            response = client.post("/v1/adapters", json={"name": "bad", "path": str(bad)})
        assert response.status_code == 409
        assert [r["code"] for r in response.json()["error"]["refusals"]] == [
            "adapter.target_mismatch"
        ]
