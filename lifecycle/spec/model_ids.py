"""Model ids: ``ORG/NAME[@REVISION]`` names a pipeline folder in the Hugging Face cache.

Wherever a spec or a pipeline folder is taken (``check``, ``run``, ``serve``, ``spec``,
a spec's ``source``, ``POST /v1/pipelines``), an argument that names an existing file
or folder is that path. Any other that reads ``ORG/NAME`` or ``ORG/NAME@REVISION``
(two names of letters, digits, ``_``, ``-`` and ``.`` that start and end with a letter,
a digit or ``_``, one slash; a name ending in a spec file's extension stays a path) is a
model id: the snapshot of that revision (a commit, a branch or a tag; ``main`` when none
is given) in the Hugging Face cache (``HF_HUB_CACHE``). ``lifecycle.spec.sources`` resolves
it through huggingface_hub, reading the cache only unless a download is asked for, and
pins it at its commit, so that reading the resolved spec again finds the same files.
What an id names, and where its snapshot lies, is decided here with no I/O.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from components.libraries import EXTRA, is_importable

__all__ = [
    "ModelId",
    "ModelIdError",
    "cache_folder",
    "parse_model_id",
    "snapshot_folder",
    "source_folder",
    "source_revision",
]

HUB_LIBRARY = "huggingface_hub"
SPEC_SUFFIXES = (".toml", ".json", ".yaml", ".yml")
"""A name ending so is a spec file, never a model id."""

_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_MODEL_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[^\s@]+))?$")


class ModelId(NamedTuple):
    """A Hugging Face model repository, at a revision.

    Attributes:
        repo: ``ORG/NAME``.
        revision: a commit hash, a branch or a tag; None for ``main``.
    """

    repo: str
    revision: str | None = None

    @property
    def name(self) -> str:
        """The repository's name without its organisation: what a pipeline is named after."""
        return self.repo.partition("/")[2]

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"


class ModelIdError(ValueError):
    """A model id cannot be resolved: not in the cache, not downloadable, or no library.

    The message names the cache folder and the fix.
    """


def parse_model_id(text: str) -> ModelId | None:
    """Return the model id ``text`` reads as, or None when it can only be a path.

    Whether a path of that name exists is the caller's to ask first: an existing path wins.
    """
    found = _MODEL_ID.match(text)
    if found is None or text.lower().endswith(SPEC_SUFFIXES):
        return None
    repo = found["repo"]
    if "--" in repo or ".." in repo:  # the Hub refuses both; the cache's folder names use "--"
        return None
    return ModelId(repo, found["revision"])


def source_revision(source: str) -> str | None:
    """Return the commit a decoded spec's ``source`` is pinned at; None for a folder's path
    (which decoding made absolute, so it never reads as an id)."""
    model_id = parse_model_id(source)
    return None if model_id is None else model_id.revision


def source_folder(source: str) -> Path:
    """Return the folder a decoded spec's ``source`` names: its path, or its pinned model
    id's snapshot in the cache.

    Raises:
        ModelIdError: it is a model id and huggingface_hub is not installed.
    """
    model_id = parse_model_id(source)
    return Path(source) if model_id is None else snapshot_folder(model_id)


def cache_folder() -> Path:
    """Return the Hugging Face cache folder huggingface_hub reads (``HF_HUB_CACHE``).

    Raises:
        ModelIdError: huggingface_hub is not installed.
    """
    if not is_importable(HUB_LIBRARY):
        raise ModelIdError(
            f"a model id is read from the Hugging Face cache by {HUB_LIBRARY}, which is not "
            f"installed (pip install 'pipeline-lifecycle[{EXTRA}]')"
        )
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def snapshot_folder(model_id: ModelId) -> Path:
    """Return the cache folder of ``model_id``'s snapshot, its revision a commit hash
    (``models--ORG--NAME/snapshots/COMMIT``, huggingface_hub's layout).

    Raises:
        ModelIdError: huggingface_hub is not installed.
    """
    cache = cache_folder()
    from huggingface_hub.file_download import repo_folder_name

    return (
        cache
        / repo_folder_name(repo_id=model_id.repo, repo_type="model")
        / "snapshots"
        / str(model_id.revision)
    )
