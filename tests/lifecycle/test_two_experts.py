"""Wan 2.2 A14B's two experts as a lifecycle: each use has a step window, the denoise stage
holds one expert at a time and hands over at the boundary, once per request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attention import Platform
from components.recipes.wan import WanRecipe
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.pictures.gantt import residency_gantt
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec, load_spec
from lifecycle.testing import capture_events, events_named
from tests.conftest import Lifecycle, PipelineFolders
from tests.lifecycle.folder_specs import largest_stage, mode_spec
from tests.lifecycle.video_requests import PROMPT, VIDEO_REQUESTS, diffusers_video, video_batch

pytestmark = pytest.mark.usefixtures("one_thread")

EXPERTS = ("transformer", "transformer_2")


@pytest.fixture(scope="module")
def a14b_video(pipeline_folder: PipelineFolders) -> torch.Tensor:
    """What diffusers' own pipeline makes of A14B's request, in [0, 1], run once for the
    tests of the file that compare to it."""
    torch.set_num_threads(1)  # the first test that asks is under one_thread too
    return diffusers_video(pipeline_folder("wan-a14b"), VIDEO_REQUESTS["wan-a14b"])


def expert_moves(moves: list[Move], request_id: str) -> list[tuple[str, str]]:
    """Return the experts' moves for ``request_id``, in order, as (component, direction)."""
    return [
        (m.component, m.direction)
        for m in moves
        if m.request_id == request_id and m.component in EXPERTS
    ]


def moves_of(moves: list[Move], request_id: str) -> list[tuple[str, str, str | None]]:
    """Return the moves made for ``request_id`` as (component, direction, reason)."""
    return [(m.component, m.direction, m.reason) for m in moves if m.request_id == request_id]


class TestHandOver:
    """Under a budget that holds one expert, each request hands over once, at the boundary."""

    def test_one_expert_budget(
        self,
        pipeline_folder: PipelineFolders,
        a14b_video: torch.Tensor,
        tmp_path: Path,
        cpu: Platform,
    ) -> None:
        """Two requests, the second a batch of two videos: each onloads ``transformer``,
        lets it go and onloads ``transformer_2`` once (never per step), the batch's videos
        crossing together; the first video of each makes diffusers' frames, the batched
        one bit for bit as it does alone."""
        folder = pipeline_folder("wan-a14b")
        spec = load_spec(mode_spec(folder, "budget", tmp_path, cpu))
        plan = Orchestrator(spec, platform=cpu).admit()
        sizes = {name: plan.components[name].bytes or 0 for name in EXPERTS}
        assert spec.memory.device_budget < sum(sizes.values())  # both cannot be resident
        moves: list[Move] = []

        def observe(event: Event) -> None:
            if isinstance(event, Move):
                moves.append(event)

        request = VIDEO_REQUESTS["wan-a14b"]
        with (
            capture_events() as events,
            Orchestrator(spec, platform=cpu, observer=observe) as orchestrator,
        ):
            orchestrator.load()
            alone = None
            for videos in (1, 2):
                batch = video_batch(request)
                if videos == 2:  # a second video, of another seed and prompt, beside it
                    recipe = orchestrator.recipe
                    assert isinstance(recipe, WanRecipe)
                    batch.size, batch.prompts = 2, [PROMPT, "a grey cat sleeps"]
                    batch.latents = [
                        recipe.video_noise(seed, request.size, request.frames)
                        for seed in (request.seed, request.seed + 1)
                    ]
                with orchestrator.request() as running:
                    running.run_all(batch)
                    request_id = running.id
                assert batch.videos is not None
                assert len(batch.videos) == videos
                ours = (batch.videos[0] / 2 + 0.5).clamp(0, 1)
                assert (ours - a14b_video).abs().max() <= 1e-5
                if alone is not None:  # what a video alone makes, when batched
                    assert torch.equal(ours, alone)
                alone = ours
                # before: the encode stage evicts the last request's transformer_2
                handed = expert_moves(moves, request_id)
                assert handed[-3:] == [
                    ("transformer", "onload"),
                    ("transformer", "offload"),
                    ("transformer_2", "onload"),
                ]
                assert [move for move in handed if move[1] == "onload"] == handed[-3::2]
                assert orchestrator.resident_bytes() <= spec.memory.device_budget
        # the budget holds the encoder or an expert: a prefetched expert would be evicted
        skipped = events_named(events, "residency.prefetch_skipped")
        assert [e["request_id"] for e in skipped] == ["r1", "r2"]
        assert skipped[0]["reason"].endswith("it would be evicted unused")
        assert not [m for m in moves if m.reason is not None]

    def test_component_offload_hands_over_once(
        self, pipeline_folder: PipelineFolders, tmp_path: Path, cpu: Platform
    ) -> None:
        """With both experts offloaded between uses, the first leaves at the boundary, before
        the second comes in, and the second after the stage; with no budget the first comes
        back for the next request while this one decodes."""
        spec = load_spec(mode_spec(pipeline_folder("wan-a14b"), "host", tmp_path, cpu))
        moves: list[Move] = []

        def observe(event: Event) -> None:
            if isinstance(event, Move):
                moves.append(event)

        with Orchestrator(spec, platform=cpu, observer=observe) as orchestrator:
            orchestrator.load()
            with orchestrator.request() as running:
                running.run_all(video_batch(VIDEO_REQUESTS["wan-a14b"]))
        assert [m for m in moves_of(moves, running.id) if m[0] in EXPERTS] == [
            ("transformer", "onload", None),
            ("transformer", "offload", None),
            ("transformer_2", "onload", None),
            ("transformer_2", "offload", None),
            ("transformer", "onload", "prefetch"),
        ]


class TestPrefetch:
    """Back to back, the next request's first expert comes in while a request decodes."""

    def test_next_requests_first_expert_onloads_during_decode(
        self, pipeline_folder: PipelineFolders, a14b_video: torch.Tensor, cpu: Platform
    ) -> None:
        """Under a budget of one expert beside the encoder, experts offloaded between uses:
        each request's decode onloads ``transformer`` for the next (reason ``prefetch``), the
        next one's denoise finds it resident, the budget is never passed, the frames are
        diffusers'; the timeline marks the bar prefetched."""
        folder = pipeline_folder("wan-a14b")
        plan = Orchestrator(load_spec(folder), platform=cpu).admit()
        sizes = {name: component.bytes or 0 for name, component in plan.components.items()}
        budget = sizes["transformer"] + max(sizes["text_encoder"], sizes["vae"])
        assert budget < sum(sizes.values())  # not all at once: the prefetch evicts
        spec = decode_spec(
            f'source = "{folder}"\ndevice = "cpu"\n[memory]\ndevice_budget = {budget}\n'
            + "".join(f'[components.{n}]\nresidency = "component_offload"\n' for n in EXPERTS)
        )
        moves: list[Move] = []
        over: list[int] = []
        request = VIDEO_REQUESTS["wan-a14b"]
        with Orchestrator(spec, platform=cpu) as orchestrator:

            def observe(event: Event) -> None:
                if isinstance(event, Move):
                    moves.append(event)
                    if orchestrator.resident_bytes() > budget:
                        over.append(orchestrator.resident_bytes())

            orchestrator.observe(observe)
            orchestrator.load()
            for _ in range(2):
                batch = video_batch(request)
                with orchestrator.request() as running:
                    running.run_all(batch)
                assert batch.videos is not None
                ours = (batch.videos[0] / 2 + 0.5).clamp(0, 1)
                assert (ours - a14b_video).abs().max() <= 1e-5
        assert not over
        first, second = moves_of(moves, "r1"), moves_of(moves, "r2")
        assert first[-1] == ("transformer", "onload", "prefetch")  # while r1 decodes
        assert [m for m in second if m[0] in EXPERTS] == [
            ("transformer", "offload", None),  # the hand-over: r2 never onloaded it
            ("transformer_2", "onload", None),
            ("transformer_2", "offload", None),
            ("transformer", "onload", "prefetch"),
        ]
        assert second.index(("vae", "onload", None)) < len(second) - 1  # decode, then prefetch
        chart = residency_gantt("a14b", list(spec.components), [moves])
        assert "prefetched, resident (r2) :transformer" in chart


class TestAdmission:
    """Admission counts one expert at a time, and says so when even one does not fit."""

    def test_a_budget_below_one_expert_is_refused_with_the_numbers(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path, cpu: Platform
    ) -> None:
        """The denoise stage's refusal names the expert's bytes and the one-at-a-time rule."""
        folder = pipeline_folder("wan-a14b")
        spec = load_spec(folder)
        plan = Orchestrator(spec, platform=cpu).admit()
        expert = plan.components["transformer"].bytes
        assert expert is not None
        path = tmp_path / "small.toml"
        path.write_text(f'source = "{folder}"\n[memory]\ndevice_budget = {expert - 1}\n')
        result = lifecycle("check", path)
        assert result.returncode == 1
        assert "stage 'denoise' needs" in result.stdout
        assert "(it holds one of transformer, transformer_2 at a time)" in result.stdout

    def test_the_largest_stage_counts_one_expert(
        self, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """A budget of the largest stage, one expert counted, is admitted."""
        spec = load_spec(pipeline_folder("wan-a14b"))
        plan = Orchestrator(spec, platform=cpu).admit()
        two = sum(plan.components[name].bytes or 0 for name in EXPERTS)
        assert largest_stage(spec, cpu) < two

    def test_check_shows_each_experts_window(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle
    ) -> None:
        """``check`` prints the denoise stage with each expert's timesteps."""
        result = lifecycle("check", pipeline_folder("wan-a14b"))
        assert result.returncode == 0, result.stdout
        assert (
            "stages: encode [text_encoder] -> denoise [transformer (t >= 875), "
            "transformer_2 (t < 875)] -> decode [vae]"
        ) in result.stdout

    def test_a_window_of_no_use_is_bad_input(self) -> None:
        """A step window must name one of its stage's uses."""
        text = (
            'name = "p"\n[components.a]\nkind = "tiny_dit"\n[[stages]]\nname = "s"\n'
            'uses = ["a"]\n[stages.windows.b]\nfrom_timestep = 1.0\n'
        )
        with pytest.raises(ConfigError) as raised:
            decode_spec(text)
        assert raised.value.path == "$.stages[0].windows.b"
