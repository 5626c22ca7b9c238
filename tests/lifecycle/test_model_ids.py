"""Model ids ``ORG/NAME[@REVISION]`` read from a Hugging Face cache, offline, through the CLI.

The commands run in processes of their own, with ``HF_HUB_CACHE`` naming a cache this
module builds in huggingface_hub's layout and ``HF_HUB_OFFLINE=1``: nothing reaches the
network, and the library reads the variables as it would for a user. The ``check`` and
``spec`` commands that ``TestResolve`` reads run one after another in one process
(``ANSWERS``), which imports the libraries once for all of them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from lifecycle.spec.model_ids import ModelId, parse_model_id
from tests.blocked_imports import blocking
from tests.components.folder_runs import Request, call_pipeline
from tests.conftest import PipelineFolders, decode_png
from tests.hub_layout import POISON, cache_repo, commit_of, hub_folder
from tests.lifecycle.cli_calls import lifecycle_calls
from tests.lifecycle.folder_specs import assert_same_pixels, pixels, run_arguments
from tests.processes import Finished, run_python

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = "tiny-org/pixart"
HUB_REPO = "tiny-org/sd3"
SIGMA = "sigma"
"""The branch of ``REPO`` whose commit holds a PixArt-Sigma folder (main holds PixArt-alpha)."""


class Cache(NamedTuple):
    """A Hugging Face cache built for these tests.

    Attributes:
        folder: the cache (``HF_HUB_CACHE``).
        main: the commit ``main`` names in ``REPO`` (a PixArt-alpha folder).
        sigma: the commit branch ``sigma`` names (a PixArt-Sigma folder).
        hub: the commit of ``HUB_REPO``: an SD3 folder laid out as the Hub ships it.
        plain: the SD3 folder it was made from.
    """

    folder: Path
    main: str
    sigma: str
    hub: str
    plain: Path


@pytest.fixture(scope="module")
def cache(pipeline_folder: PipelineFolders, tmp_path_factory: pytest.TempPathFactory) -> Cache:
    """Build the cache: two revisions of ``REPO`` and one of ``HUB_REPO``."""
    folder = tmp_path_factory.mktemp("hf-cache")
    main, sigma, hub = commit_of("main"), commit_of(SIGMA), commit_of("hub")
    cache_repo(folder, REPO, pipeline_folder("pixart"), main)
    cache_repo(folder, REPO, pipeline_folder("pixart-sigma"), sigma, {SIGMA: sigma})
    laid_out = hub_folder(pipeline_folder("sd3"), tmp_path_factory.mktemp("hub") / "sd3")
    cache_repo(folder, HUB_REPO, laid_out, hub)
    return Cache(folder, main, sigma, hub, pipeline_folder("sd3"))


@pytest.fixture
def offline(cache: Cache, monkeypatch: pytest.MonkeyPatch) -> Cache:
    """Point huggingface_hub at the cache, offline, in the processes the test starts."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache.folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def lifecycle_process(*args: str | Path, cwd: Path, before: str = "") -> Finished:
    """Run ``lifecycle *args`` in a process of its own in ``cwd``; ``before`` runs first."""
    argv = [str(arg) for arg in args]
    program = f"{before}\nfrom lifecycle.cli.entry import main\nraise SystemExit(main({argv!r}))"
    return run_python(program, cwd=cwd)


class Answer(NamedTuple):
    """What one call of ``ANSWERS`` left, and the folder it ran in."""

    result: Finished
    cwd: Path


ANSWERS = {
    "revisions": ("check", "--json", REPO, f"{REPO}@{SIGMA}", "{main}"),
    "table": ("check", f"{REPO}@{SIGMA}"),
    "spec": ("spec", "spec.toml"),
    "existing": ("check", "--json", REPO),
    "absent": ("check", "tiny-org/absent"),
    "no-branch": ("check", f"{REPO}@no-such-branch"),
    "absent-json": ("check", "--json", "tiny-org/absent"),
    "download": ("check", "--json", REPO, "--download"),
    "download-absent": ("check", "tiny-org/absent", "--download"),
}
"""The ``lifecycle`` calls ``TestResolve`` reads, by name (``{main}``: ``REPO`` at the commit
of ``main``). Each runs in a folder of its own; ``existing``'s holds a pipeline folder at
the relative path ``REPO``, ``spec``'s a spec naming ``REPO@SIGMA``."""


@pytest.fixture(scope="module")
def answers(
    cache: Cache, pipeline_folder: PipelineFolders, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Answer]:
    """Run every call of ``ANSWERS`` in one process, offline on the cache; return each
    one's answer by name."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ANSWERS}
    shutil.copytree(pipeline_folder("pixart-sigma"), folders["existing"] / REPO)
    (folders["spec"] / "spec.toml").write_text(f'source = "{REPO}@{SIGMA}"\nname = "mine"\n')
    main = f"{REPO}@{cache.main}"
    calls = [
        (folders[name], [arg.replace("{main}", main) for arg in argv])
        for name, argv in ANSWERS.items()
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(cache.folder))
        patch.setenv("HF_HUB_OFFLINE", "1")
        results = lifecycle_calls(calls)
    return {
        name: Answer(result, folders[name]) for name, result in zip(ANSWERS, results, strict=True)
    }


def admitted(answer: Answer) -> dict[str, object]:
    """Return the report of a ``check --json`` answer; it must have admitted its sources."""
    assert answer.result.returncode == 0, answer.result.stderr
    report: dict[str, object] = json.loads(answer.result.stdout)
    return report


class TestTheRule:
    """What reads as a model id, and what stays a path."""

    @pytest.mark.parametrize(
        ("text", "found"),
        [
            ("PixArt-alpha/PixArt-XL-2-512x512", ModelId("PixArt-alpha/PixArt-XL-2-512x512")),
            ("org/sd-3.5_medium@main", ModelId("org/sd-3.5_medium", "main")),
            ("org/name@refs/pr/1", ModelId("org/name", "refs/pr/1")),
            ("org/name@" + "a" * 40, ModelId("org/name", "a" * 40)),
            ("org/spec.toml", None),  # a spec file's extension: a path
            ("org/spec.YAML", None),
            ("./org/name", None),
            ("../org/name", None),
            ("/abs/org/name", None),
            ("name", None),
            ("a/b/c", None),
            ("org/-name", None),
            ("org/name.", None),
            ("org--x/name", None),
            ("org/name@", None),
            ("org/name@a b", None),
        ],
    )
    def test_ids_and_paths(self, text: str, found: ModelId | None) -> None:
        """Two names and one slash (and a revision after ``@``) read as an id; what starts
        with ``.`` or ``/``, has another slash, or ends in a spec's extension does not."""
        assert parse_model_id(text) == found


class TestResolve:
    """``check``, ``spec`` and ``run`` take a model id and read it from the cache."""

    def test_main_a_branch_and_a_commit(self, cache: Cache, answers: dict[str, Answer]) -> None:
        """No revision reads ``refs/main``'s commit; ``@BRANCH`` reads ``refs/BRANCH``'s;
        ``@COMMIT`` that snapshot: ``check --json`` shows each one's source and revision."""
        pipelines = admitted(answers["revisions"])["pipelines"]
        assert isinstance(pipelines, list)
        assert [(p["pipeline"], p["source"], p["revision"]) for p in pipelines] == [
            ("pixart", f"{REPO}@{cache.main}", cache.main),
            ("pixart", f"{REPO}@{cache.sigma}", cache.sigma),
            ("pixart", f"{REPO}@{cache.main}", cache.main),
        ]

    def test_the_table_shows_the_revision_and_folder(
        self, cache: Cache, answers: dict[str, Answer]
    ) -> None:
        """``check`` (a table) names the id, the revision it resolved to and its folder."""
        result = answers["table"].result
        assert result.returncode == 0, result.stderr
        snapshot = cache.folder / "models--tiny-org--pixart" / "snapshots" / cache.sigma
        assert f"  source: {REPO} at revision {cache.sigma} ({snapshot})\n" in result.stdout

    def test_a_spec_names_an_id_and_prints_it_pinned(
        self, offline: Cache, answers: dict[str, Answer]
    ) -> None:
        """A spec's ``source`` may be an id; ``lifecycle spec`` prints it at its commit, with
        the components' files in the snapshot, and that TOML prints the same again."""
        first, folder = answers["spec"]
        assert first.returncode == 0, first.stderr
        snapshot = offline.folder / "models--tiny-org--pixart" / "snapshots" / offline.sigma
        assert f'source = "{REPO}@{offline.sigma}"\n' in first.stdout
        assert f'path = "{snapshot / "transformer"}"\n' in first.stdout
        again = folder / "again.toml"
        again.write_text(first.stdout)
        assert lifecycle_process("spec", again, cwd=folder).stdout == first.stdout

    def test_an_existing_path_wins(self, answers: dict[str, Answer]) -> None:
        """A folder whose relative path reads like an id is that folder, not the cache's."""
        answer = answers["existing"]
        report = admitted(answer)
        assert (report["source"], report["revision"]) == (str(answer.cwd / REPO), None)

    def test_a_missing_id_is_bad_input_naming_the_cache_and_the_flag(
        self, cache: Cache, answers: dict[str, Answer]
    ) -> None:
        """An id the cache lacks (or a revision it lacks) exits 2 with one line naming the
        cache folder and ``--download``; ``--json`` prints the error at ``$.source``."""
        for name, missing in (
            ("absent", "tiny-org/absent"),
            ("no-branch", f"{REPO}@no-such-branch"),
        ):
            result, folder = answers[name]
            assert result.returncode == 2
            repo, _, revision = missing.partition("@")
            assert result.stderr == (
                f"lifecycle check: {missing}: Expected a pipeline folder or a model id in the "
                f"Hugging Face cache, got '{missing}': there is no file or folder at "
                f"{folder / missing}, and model {repo} (revision {revision or 'main'}) is "
                f"not in the Hugging Face cache {cache.folder}; download it with --download "
                "(in a spec: source_download = true), or set HF_HUB_CACHE to the cache that "
                "holds it - at `$.source`\n"
            )
        result = answers["absent-json"].result
        assert result.returncode == 2
        assert json.loads(result.stdout)["error"]["path"] == "$.source"

    def test_download_reads_the_cache_and_never_the_network_offline(
        self, cache: Cache, answers: dict[str, Answer]
    ) -> None:
        """``--download`` (offline here) still reads a cached id; one the cache lacks is bad
        input saying the download failed, and why."""
        assert admitted(answers["download"])["revision"] == cache.main
        result = answers["download-absent"].result
        assert result.returncode == 2
        assert "cannot download model tiny-org/absent (revision main) into the Hugging " in (
            result.stderr
        )
        assert "HF_HUB_OFFLINE=0" in result.stderr

    def test_without_huggingface_hub_an_id_names_the_extra(
        self, offline: Cache, tmp_path: Path
    ) -> None:
        """Where huggingface_hub cannot be imported, an id is bad input naming the extra."""
        before = blocking("huggingface_hub")
        result = lifecycle_process("check", REPO, cwd=tmp_path, before=before)
        assert result.returncode == 2
        assert (
            "a model id is read from the Hugging Face cache by huggingface_hub, which is not "
            "installed (pip install 'pipeline-lifecycle[diffusers]')"
        ) in result.stderr


NO_PICKLES = """
import sys


def refuse_pickles(event, args):
    if event == "open" and str(args[0]).endswith(".bin"):
        raise RuntimeError("opened " + str(args[0]))


sys.addaudithook(refuse_pickles)
"""
"""A program's start that makes every open of a ``.bin`` file fail, loudly."""


class TestRun:
    def test_an_id_with_its_variant_makes_diffusers_image(
        self, offline: Cache, tmp_path: Path
    ) -> None:
        """``run`` of a spec naming a hub-laid-out id with ``variant = "fp16"`` writes the
        image diffusers makes from that snapshot with ``variant="fp16"`` (not the one from
        the full files), and opens no pickled ``.bin`` on the way."""
        request = Request(negative_prompt="a grey dog", size=(32, 64), steps=2, seed=2)
        spec = tmp_path / "spec.toml"
        spec.write_text(f'source = "{HUB_REPO}"\nvariant = "fp16"\n')
        out = tmp_path / "out"
        arguments = (*run_arguments(request), "--requests", "1", "--out", out)
        result = lifecycle_process("run", spec, *arguments, cwd=tmp_path, before=NO_PICKLES)
        assert result.returncode == 0, result.stderr
        ours = decode_png((out / "r1-0.png").read_bytes())
        snapshot = offline.folder / "models--tiny-org--sd3" / "snapshots" / offline.hub
        variant, full = (_diffusers(snapshot, request, v) for v in ("fp16", None))
        assert_same_pixels(ours, pixels(variant)[0])
        assert (variant - full).abs().max() > 0.05  # the two files make other images
        with pytest.raises(RuntimeError, match=POISON):  # and a pickle would have said so
            torch.load(snapshot / "vae" / "diffusion_pytorch_model.bin", weights_only=False)


def _diffusers(folder: Path, request: Request, variant: str | None) -> torch.Tensor:
    """Return diffusers' image of ``request`` from ``folder``'s ``variant`` files."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder), variant=variant)
    return call_pipeline(pipeline, request, negative_prompt=request.negative_prompt)
