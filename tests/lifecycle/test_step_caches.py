"""Step caches of a folder's DiT through the lifecycle: spec, check, run and requests.

The folders are the tiny PixArt and Flux ones written with ``smooth_time=True``
(``benchmarks.make_pipeline --smooth-time``): their timestep MLP reads only the slow
half of its frequencies, so that adjacent steps differ as a trained model's do (a first
block changes by ~0.07 a step, not ~0.5) and a cache has steps to skip. Every run here
asserts that it skipped some.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
import torch

from attention import Platform
from components.batch import Batch
from components.cache import CacheSteps
from lifecycle.device.shared import SharedDevice
from lifecycle.events import Event, Move, RequestEnded
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec
from lifecycle.testing import capture_events, events_named
from tests.conftest import Lifecycle, PipelineFolders, decode_png
from tests.lifecycle.cache_rows import assert_each_row_alone
from tests.lifecycle.folder_specs import largest_stage

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("pixart", "flux")
METHODS = ("first_block", "taylor_seer")
MIN_PSNR = 30.0
"""The PSNR (dB) of a cached image against the uncached one that the tests hold the
default settings to; the README names settings under it lossy."""
SIZE = "64x64"


def cache_table(method: str, extra: str = "") -> str:
    """Return a ``[components.transformer.cache]`` table of ``method`` (and ``extra`` lines)."""
    return f'[components.transformer.cache]\nmethod = "{method}"\n{extra}\n'


def folder_spec(folder: Path, into: Path, cache: str = "") -> Path:
    """Write a spec over ``folder`` with ``cache`` (a table, or nothing) and return its path."""
    path = into / f"spec-{abs(hash(cache))}.toml"
    path.write_text(f'source = "{folder}"\ndevice = "cpu"\n{cache}')
    return path


def psnr(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Return the PSNR of 8-bit images ``ours`` against ``reference`` in dB."""
    mse = float(((ours.double() - reference.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def run_image(lifecycle: Lifecycle, spec: Path, out: Path) -> tuple[dict[str, object], bytes]:
    """Run one request of ``spec`` as ``lifecycle run --json --out``; its report and PNG."""
    result = lifecycle(
        "run", spec, "--json", "--requests", "1", "--threads", "1", "--size", SIZE,
        "--prompt", "a red fox in the snow", "--out", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout)["summary"]
    return report, (out / "r1-0.png").read_bytes()


@pytest.fixture(scope="module")
def smooth(pipeline_folder: PipelineFolders) -> dict[str, Path]:
    """The tiny PixArt and Flux folders whose steps differ as a trained model's do."""
    return {family: pipeline_folder(family, smooth_time=True) for family in FAMILIES}


class TestRun:
    """``lifecycle run`` with a cache: skipped steps, counted, close to the uncached image."""

    @pytest.mark.parametrize("family", FAMILIES)
    def test_each_method_skips_within_the_stated_psnr(
        self, family: str, smooth: dict[str, Path], lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """Both methods skip steps at their defaults (``run --json`` counts them per
        component), and each image stays above 30 dB of the uncached one."""
        folder = smooth[family]
        _, uncached = run_image(lifecycle, folder_spec(folder, tmp_path), tmp_path / "plain")
        reference = decode_png(uncached)
        for method in METHODS:
            spec = folder_spec(folder, tmp_path, cache_table(method))
            report, png = run_image(lifecycle, spec, tmp_path / method)
            components = report["components"]
            assert isinstance(components, dict)
            counted = components["transformer"]["cache"]
            steps = {"pixart": 20, "flux": 28}[family]
            assert counted["computed"] + counted["skipped"] == steps, counted
            assert counted["skipped"] > 0, (method, counted)
            assert components["vae"]["cache"] is None
            assert psnr(decode_png(png), reference) > MIN_PSNR, (method, counted)

    def test_request_end_and_the_summary_say_what_was_skipped(
        self, smooth: dict[str, Path], lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``request.end`` carries the request's ``cache_skipped``; the table a cache column."""
        spec = folder_spec(smooth["flux"], tmp_path, cache_table("taylor_seer"))
        result = lifecycle(
            "--log-level", "info", "--log-format", "json", "run", spec, "--requests", "1",
            "--threads", "1", "--size", SIZE, "--prompt", "a fox",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        (ended,) = [
            e for e in map(json.loads, result.stderr.splitlines()) if e["event"] == "request.end"
        ]
        assert ended["cache_skipped"] > 0
        assert ended["cache_uncached"] == 0
        header = result.stdout.splitlines()[1].split()
        assert header[-1] == "cache"
        row = next(
            line for line in result.stdout.splitlines() if line.strip().startswith("transformer")
        )
        assert f"{28 - ended['cache_skipped']} computed, {ended['cache_skipped']} skipped" in row


class TestBatches:
    """Rows of a packed forward decide alone."""

    def test_three_sizes_with_and_without_the_cache_each_equal_alone(
        self, smooth: dict[str, Path]
    ) -> None:
        """Three sizes in one packed batch, the middle one with ``cache = False``: each
        image's latents equal its request run alone (1e-5, float32), and so do the skips."""
        spec = decode_spec(
            f'source = "{smooth["flux"]}"\ndevice = "cpu"\n' + cache_table("first_block")
        )
        sizes = [(32, 32), (48, 32), (64, 64)]
        flags = [True, False, True]
        with Orchestrator(spec, platform=Platform("cpu")) as pipeline:
            pipeline.admit()
            pipeline.load()
            recipe = pipeline.recipe
            assert recipe is not None

            def run(rows: list[int]) -> Batch:
                latents = [
                    x
                    for row in rows
                    for x in recipe.draw_latents(torch.Generator().manual_seed(row), 1, sizes[row])
                ]
                batch = Batch(
                    generator=torch.Generator().manual_seed(0),
                    steps=28,
                    size=len(rows),
                    prompts=[f"a fox, number {row}" for row in rows],
                    image_sizes=[sizes[row] for row in rows],
                    latents=latents,
                    cache=[flags[row] for row in rows],
                )
                with pipeline.request() as request:
                    request.run("encode", batch)
                    request.run("denoise", batch)
                return batch

            assert_each_row_alone(run, flags)

    def test_request_end_counts_the_rows_that_ran_the_cache(self, smooth: dict[str, Path]) -> None:
        """The observer's ``RequestEnded`` counts image steps of the cached rows only, and
        a request too short to skip counts its rows as uncached; its log line says the same."""
        spec = decode_spec(
            f'source = "{smooth["pixart"]}"\ndevice = "cpu"\n' + cache_table("taylor_seer")
        )
        ended: list[RequestEnded] = []

        def observe(event: Event) -> None:
            if isinstance(event, RequestEnded):
                ended.append(event)

        with (
            capture_events() as logs,
            Orchestrator(spec, platform=Platform("cpu"), observer=observe) as pipeline,
        ):
            pipeline.admit()
            pipeline.load()
            for steps, flags in ((8, [True, False]), (3, [True, True])):
                batch = Batch(
                    generator=torch.Generator().manual_seed(0),
                    steps=steps,
                    size=2,
                    prompts=["a fox", "a cat"],
                    image_size=(64, 64),
                    cache=flags,
                )
                with pipeline.request() as request:
                    request.run("encode", batch)
                    request.run("denoise", batch)
        counted, short = (e.cache["transformer"] for e in ended)
        assert counted.computed + counted.skipped == 8
        assert counted.skipped > 0
        assert counted.uncached == 0
        assert short == CacheSteps(computed=6, skipped=0, uncached=2)
        assert ended[1].cache_skipped == 0
        lines = events_named(logs, "request.end")
        assert [line["cache"] for line in lines] == [msgspec.to_builtins(e.cache) for e in ended]
        assert [line["cache_skipped"] for line in lines] == [counted.skipped, 0]
        assert [line["cache_uncached"] for line in lines] == [0, 2]


class TestOptions:
    """A cache with adapters and a per-request attention backend: each still applies."""

    def test_adapters_and_an_override_run_under_the_cache(
        self, smooth: dict[str, Path], tmp_path: Path
    ) -> None:
        """A merged and an unmerged LoRA, and a request on the reference backend, each skip
        steps and stay above 30 dB of the same request uncached; the LoRA changes the image."""
        from benchmarks.make_adapter import DEFAULT_TARGETS, linear_shapes, write_lora

        folder = smooth["flux"]
        shapes = linear_shapes(folder, "transformer", DEFAULT_TARGETS)
        lora = write_lora(shapes, tmp_path / "lora.safetensors", prefix="transformer")
        adapters = "".join(
            f'[adapters.{mode}]\npath = "{lora}"\nmode = "{mode}"\nscale = 2.0\n'
            for mode in ("merged", "unmerged")
        )

        asked = ((None, None), ("merged", None), ("unmerged", None), (None, "reference"))

        def run(cache: str) -> list[torch.Tensor]:
            spec = decode_spec(f'source = "{folder}"\ndevice = "cpu"\n{cache}{adapters}')
            found = []
            with Orchestrator(spec, platform=Platform("cpu")) as pipeline:
                pipeline.admit()
                pipeline.load()
                for adapter, backend in asked:
                    batch = Batch(
                        generator=torch.Generator().manual_seed(0),
                        steps=28,
                        prompts=["a fox"],
                        image_size=(64, 64),
                        adapters=None if adapter is None else [{adapter: 2.0}],
                    )
                    with pipeline.request(attention_backend=backend) as request:
                        request.run("encode", batch)
                        request.run("denoise", batch)
                    rows = batch.cache_rows
                    if rows is not None:
                        assert rows[0] is not None
                        assert rows[0].skipped > 0, (adapter, backend, rows[0].pattern)
                    found.append((batch.latents or [])[0])
            return found

        cached, uncached = run(cache_table("first_block")), run("")
        for (adapter, backend), ours, reference in zip(asked, cached, uncached, strict=True):
            peak = float(reference.max() - reference.min())
            mse = float(((ours - reference) ** 2).mean())
            assert 10 * math.log10(peak**2 / mse) > MIN_PSNR, (adapter, backend)
            if adapter is not None:
                assert not torch.allclose(ours, cached[0], atol=1e-3)


class TestSharing:
    """Pipelines on one device share a component only when they run it alike."""

    def test_a_component_with_another_cache_is_held_apart(self, root: Path) -> None:
        """Two tiny-t2i pipelines differing only in the DiT's cache share the text encoder
        and VAE, not the DiT: each request runs its own pipeline's cache (or none)."""
        text = (root / "examples" / "tiny_t2i.toml").read_text()
        cached = text.replace('name = "tiny-t2i"', 'name = "cached"') + cache_table(
            "taylor_seer"
        ).replace("\n\n", "\n")
        device = SharedDevice()
        with (
            Orchestrator(decode_spec(cached), shared=device) as a,
            Orchestrator(decode_spec(text), shared=device) as b,
        ):
            for pipeline in (a, b):
                pipeline.admit()
                pipeline.load()
            assert a.module("vae") is b.module("vae")
            assert a.module("transformer") is not b.module("transformer")
            for pipeline, expect in ((a, True), (b, False)):
                batch = Batch(generator=torch.Generator().manual_seed(0), steps=12)
                with pipeline.request() as request:
                    request.run_all(batch)
                assert (batch.cache_rows is not None) == expect


class TestResidency:
    """A cache under offload: the same output, and blocks it skips never stream."""

    def test_offload_keeps_the_output_and_streams_only_the_blocks_that_run(
        self, smooth: dict[str, Path], tmp_path: Path
    ) -> None:
        """Streaming Flux's blocks (prefetch 1), offloading it whole to the host or to
        disk, or under a budget of its largest stage (each stage evicts the last),
        taylor_seer's output equals the resident cached run's, and the block bytes
        ``residency.moved`` reports fall with the steps skipped, exactly: a predicted step
        calls no block."""
        folder = smooth["flux"]
        budget = largest_stage(decode_spec(f'source = "{folder}"\ndevice = "cpu"'), Platform("cpu"))
        memory = {
            "disk": f'[memory]\noffload_target = "disk"\noffload_dir = "{tmp_path}"\n',
            "budget": f"[memory]\ndevice_budget = {budget}\n",
        }
        residencies = {"disk": "component_offload", "budget": ""}

        def run(mode: str, cache: str) -> tuple[torch.Tensor, int, int]:
            residency = residencies.get(mode, mode)
            table = f'[components.transformer]\nresidency = "{residency}"\n' if residency else ""
            memory_table = memory.get(mode, "")
            spec = decode_spec(f'source = "{folder}"\ndevice = "cpu"\n{memory_table}{table}{cache}')
            streamed = [0]
            onloads: list[str | None] = []

            def observe(event: Event) -> None:
                if isinstance(event, Move) and event.component == "transformer":
                    streamed[0] += event.streamed
                    if event.direction == "onload":
                        onloads.append(event.request_id)

            with Orchestrator(spec, platform=Platform("cpu"), observer=observe) as pipeline:
                pipeline.admit()
                pipeline.load()
                batch = Batch(
                    generator=torch.Generator().manual_seed(0),
                    steps=12,
                    prompts=["a fox"],
                    image_size=(64, 64),
                )
                with pipeline.request() as request:
                    request.run("encode", batch)
                    request.run("denoise", batch)
            if mode == "budget":  # evicted before the request: it came back for it
                assert onloads[-1] is not None
            rows = batch.cache_rows
            computed = 12 if rows is None or rows[0] is None else rows[0].computed
            return (batch.latents or [])[0], streamed[0], computed

        taylor = cache_table("taylor_seer")
        resident, _, computed = run("", taylor)
        streaming, streamed, also = run("layerwise_offload", taylor)
        _, uncached, _ = run("layerwise_offload", "")
        on_host, _, _ = run("component_offload", taylor)
        on_disk, _, _ = run("disk", taylor)
        evicting, _, _ = run("budget", taylor)
        assert torch.equal(streaming, resident)
        assert torch.equal(on_host, resident)
        assert torch.equal(on_disk, resident)
        assert torch.equal(evicting, resident)
        assert also == computed < 12
        assert uncached > 0
        assert streamed * 12 == uncached * computed


class TestCheck:
    """``check`` shows each component's cache, and refuses one nothing would honour."""

    def test_the_cache_is_in_the_table_and_the_json(
        self, smooth: dict[str, Path], lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """The table gets a cache column with every default; ``--json`` the resolved table,
        null for components without one."""
        spec = folder_spec(smooth["flux"], tmp_path, cache_table("first_block", "max_skipped = 3"))
        table = lifecycle("check", spec)
        assert table.returncode == 0, table.stderr
        assert "first_block (threshold 0.08; warmup 2, final 1, max 3 skipped)" in table.stdout
        result = lifecycle("check", "--json", spec)
        components = json.loads(result.stdout)["components"]
        assert components["transformer"]["cache"] == {
            "method": "first_block",
            "warmup_steps": 2,
            "final_steps": 1,
            "max_skipped": 3,
            "threshold": 0.08,
        }
        assert components["vae"]["cache"] is None

    @pytest.mark.parametrize(
        ("table", "path", "message"),
        [
            (
                'method = "first_block"\ninterval = 3',
                "$.components.transformer.cache",
                'interval is a key of method "taylor_seer", not of "first_block"',
            ),
            ('method = "taylor_seer"\norder = 9', "$.components.transformer.cache.order", "<= 4"),
            (
                'method = "first_block"\nthreshold = 0',
                "$.components.transformer.cache.threshold",
                "> 0",
            ),
            (
                'method = "mag_cache"',
                "$.components.transformer.cache.method",
                "first_block | taylor_seer",
            ),
        ],
    )
    def test_bad_values_are_bad_input(
        self,
        table: str,
        path: str,
        message: str,
        smooth: dict[str, Path],
        lifecycle: Lifecycle,
        tmp_path: Path,
    ) -> None:
        """A key of the other method, or a value out of range, is exit 2 naming the key."""
        spec = folder_spec(smooth["flux"], tmp_path, f"[components.transformer.cache]\n{table}\n")
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 2
        error = json.loads(result.stdout)["error"]
        assert error["path"] == path
        assert message in error["message"]

    @pytest.mark.parametrize(
        ("component", "table", "code"),
        [
            ("text_encoder_2", 'method = "first_block"', "acceleration.cache_unsupported"),
            ("vae", 'method = "taylor_seer"', "acceleration.cache_unsupported"),
            (
                "transformer",
                'method = "taylor_seer"\nwarmup_steps = 20\nfinal_steps = 8',
                "acceleration.cache_steps",
            ),
        ],
    )
    def test_a_cache_nothing_honours_is_refused(
        self,
        component: str,
        table: str,
        code: str,
        smooth: dict[str, Path],
        lifecycle: Lifecycle,
        tmp_path: Path,
    ) -> None:
        """A text encoder or a VAE has no block stack to skip; Flux's 28 default steps leave
        none to a warm-up of 20 and 8 final steps: refused by ``check --json``, exit 1."""
        spec = folder_spec(smooth["flux"], tmp_path, f"[components.{component}.cache]\n{table}\n")
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 1
        (refusal,) = json.loads(result.stdout)["refusals"]
        assert (refusal["code"], refusal["component"]) == (code, component)
        assert refusal["hint"]

    def test_native_diffusers_class_without_a_hook_is_refused(
        self, smooth: dict[str, Path], lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """PixArt's diffusers class has no cache hook: a cache on the native path is refused."""
        cache = cache_table("first_block").replace(
            "[components.transformer.cache]",
            '[components.transformer]\nloader = "native"\n[components.transformer.cache]',
        )
        result = lifecycle("check", "--json", folder_spec(smooth["pixart"], tmp_path, cache))
        assert result.returncode == 1
        (refusal,) = json.loads(result.stdout)["refusals"]
        assert refusal["code"] == "acceleration.cache_unsupported"
        assert "native" in refusal["message"]
