"""The prompt-embedding cache: a batch of cached prompts never uses its text encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attention import Platform
from benchmarks.make_adapter import linear_shapes, write_lora
from benchmarks.make_pipeline import Family
from lifecycle.events import Event, Move, PromptCounts, RequestEnded
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import PipelineSpec
from tests.components.folder_runs import Request, batch_of
from tests.conftest import Lifecycle, PipelineFolders
from tests.lifecycle.folder_specs import REQUESTS, run_arguments

pytestmark = pytest.mark.usefixtures("one_thread")


def cached_spec(folder: Path, capacity: str = "1MiB") -> PipelineSpec:
    """Return the spec of ``folder`` with a prompt cache of ``capacity`` and its text
    encoder offloaded after each use (so that each use is a move)."""
    return decode_spec(
        f'source = "{folder}"\ndevice = "cpu"\n[serving]\nprompt_cache_bytes = "{capacity}"\n'
        '[components.text_encoder]\nresidency = "component_offload"\n'
    )


class Requests:
    """An orchestrator's requests, one at a time: each one's images, the text encoder's
    moves and the prompt cache's counts."""

    def __init__(self, spec: PipelineSpec, cpu: Platform) -> None:
        self.events: list[Event] = []
        self.orchestrator = Orchestrator(spec, platform=cpu, observer=self.events.append)
        self.orchestrator.load()

    def run(
        self, request: Request, adapters: dict[str, float] | None = None
    ) -> tuple[torch.Tensor, int, PromptCounts | None]:
        """Run ``request`` (each row with ``adapters``); return its images, the text
        encoder's moves and the counts."""
        self.events.clear()
        batch = batch_of(request)
        batch.adapters = None if adapters is None else [adapters] * request.count
        with self.orchestrator.request() as running:
            running.run_all(batch)
        assert isinstance(batch.images, torch.Tensor)
        moves = [e for e in self.events if isinstance(e, Move) and e.component == "text_encoder"]
        (ended,) = [e for e in self.events if isinstance(e, RequestEnded)]
        return batch.images, len(moves), ended.prompts

    def close(self) -> None:
        """Release the pipeline."""
        self.orchestrator.close()


class TestMoves:
    """What the plan knows before the encode stage: whether the text encoder is needed."""

    def test_a_repeated_prompt_makes_no_move_of_the_text_encoder(
        self, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """The second request of a prompt leaves the encoder offloaded and makes the first's
        image; a new prompt onloads it again."""
        requests = Requests(cached_spec(pipeline_folder("qwen-image")), cpu)
        first = REQUESTS["qwen-image"]
        try:
            encoded, moved, counts = requests.run(first)
            assert (moved, counts) == (2, PromptCounts(misses=1))  # onload, offload
            cached, moved, counts = requests.run(first._replace(seed=first.seed))
            assert (moved, counts) == (0, PromptCounts(hits=1))
            assert torch.equal(cached, encoded)
            _, moved, counts = requests.run(first._replace(prompt="a white owl at night"))
            assert (moved, counts) == (2, PromptCounts(misses=1))
        finally:
            requests.close()

    @pytest.mark.parametrize(
        "change",
        [
            {"negative_prompt": "a red car"},  # true CFG against another text
            {"negative_prompt": None, "guidance_scale": 1.0},  # no negative branch at all
        ],
    )
    def test_what_the_text_depends_on_is_in_the_key(
        self, change: dict[str, object], pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """The same prompt with another negative prompt, or unguided, is encoded again."""
        requests = Requests(cached_spec(pipeline_folder("qwen-image")), cpu)
        try:
            requests.run(REQUESTS["qwen-image"])
            _, moved, counts = requests.run(REQUESTS["qwen-image"]._replace(**change))
            assert (moved, counts) == (2, PromptCounts(misses=1))
        finally:
            requests.close()

    def test_rows_larger_than_the_bound_are_never_kept(
        self, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """Under a bound smaller than one encoded prompt, every request encodes."""
        requests = Requests(cached_spec(pipeline_folder("z-image"), capacity="64B"), cpu)
        try:
            for _ in range(2):
                _, moved, counts = requests.run(REQUESTS["z-image"])
                assert (moved, counts) == (2, PromptCounts(misses=1))
        finally:
            requests.close()


@pytest.mark.parametrize("family", list(REQUESTS))
def test_the_cached_text_makes_the_encoded_image(
    family: Family, pipeline_folder: PipelineFolders, cpu: Platform
) -> None:
    """For every class, two images of one cached prompt equal the encoded one's exactly."""
    request = REQUESTS[family]._replace(count=2)
    requests = Requests(cached_spec(pipeline_folder(family)), cpu)
    try:
        encoded, _, _ = requests.run(request)
        cached, moved, counts = requests.run(request)
    finally:
        requests.close()
    assert (moved, counts) == (0, PromptCounts(hits=2))
    assert torch.equal(cached, encoded)


class TestReported:
    """``run --json`` and the host-memory check see the cache (``/metrics``: in serving/)."""

    def test_run_json_counts_hits(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """Two requests of one prompt: one encoded, one cached; the encoder onloads once."""
        spec = tmp_path / "cached.toml"
        folder = pipeline_folder("z-image")
        spec.write_text(
            f'source = "{folder}"\ndevice = "cpu"\n[serving]\nprompt_cache_bytes = "1MiB"\n'
            '[components.text_encoder]\nresidency = "component_offload"\n'
        )
        arguments = run_arguments(REQUESTS["z-image"])
        result = lifecycle("run", spec, *arguments, "--requests", "2", "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)["summary"]
        assert report["prompt_cache"] == {"hits": 1, "misses": 1}
        assert report["components"]["text_encoder"]["onloads"] == 1

    def test_the_host_memory_check_counts_the_cache(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A cache larger than the host's memory is refused at check, naming its key."""
        spec = tmp_path / "huge.toml"
        spec.write_text(
            f'source = "{pipeline_folder("z-image")}"\n[serving]\nprompt_cache_bytes = "64TiB"\n'
        )
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 1
        (refusal,) = json.loads(result.stdout)["refusals"]
        assert refusal["code"] == "residency.host_memory"
        assert f"prompt cache {64 * 2**40} B" in refusal["message"]  # sizes apart to the byte
        assert "lower serving.prompt_cache_bytes" in refusal["hint"]


def test_an_adapter_on_the_encoder_is_part_of_the_key(
    pipeline_folder: PipelineFolders, tmp_path: Path, cpu: Platform
) -> None:
    """A prompt cached without the encoder's LoRA is encoded again with it, then cached."""
    folder = pipeline_folder("z-image")
    shapes = linear_shapes(folder, "text_encoder", ("q_proj", "v_proj"))
    lora = write_lora(shapes, tmp_path / "style.safetensors", prefix="text_encoder")
    spec = decode_spec(
        f'source = "{folder}"\ndevice = "cpu"\n[serving]\nprompt_cache_bytes = "1MiB"\n'
        '[components.text_encoder]\nresidency = "component_offload"\n'
        f'[adapters.style]\npath = "{lora}"\ncomponent = "text_encoder"\nmode = "unmerged"\n'
    )
    requests = Requests(spec, cpu)
    request = REQUESTS["z-image"]
    try:
        plain, _, _ = requests.run(request)
        styled, moved, counts = requests.run(request, {"style": 1.0})
        assert (moved, counts) == (2, PromptCounts(misses=1))
        assert not torch.equal(styled, plain)
        again, moved, counts = requests.run(request, {"style": 1.0})
        assert (moved, counts) == (0, PromptCounts(hits=1))
        assert torch.equal(again, styled)
    finally:
        requests.close()
