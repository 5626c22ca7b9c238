"""PixArt's aspect-ratio bins: read from diffusers' source as diffusers holds them, the
nearest chosen as diffusers chooses it, and neither diffusers' pipelines nor transformers
imported for them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from components.recipes.aspect_bins import BinsNotFound, nearest_bin, read_bins
from components.recipes.pixart import PixArtAlphaRecipe, PixArtSigmaRecipe
from tests.conftest import PipelineFolders
from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]

TABLES = sorted({*PixArtAlphaRecipe.bin_tables.values(), *PixArtSigmaRecipe.bin_tables.values()})
"""Every (module, name) a PixArt recipe reads its bins from."""

SIDES = range(8, 4200, 40)
"""Heights and widths from far below the smallest bin to beyond the largest, both ways."""

BINNING = """
import sys
from pathlib import Path
from tests.components.folder_runs import recipe_of
recipe = recipe_of(Path(sys.argv[1]))
print(recipe.binned((64, 96)), sorted(name for name in sys.argv[2:] if name in sys.modules))
"""

HEAVY = (
    "diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha",
    "diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma",
    "transformers.modeling_utils",
)
"""What diffusers' PixArt pipeline modules import: the pipelines and transformers' models."""


def moved(root: Path, source: str) -> str:
    """Write package ``moved_bins`` under ``root`` with module ``pipeline`` holding
    ``source``; return the module's dotted name."""
    package = root / "moved_bins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipeline.py").write_text(source)
    return "moved_bins.pipeline"


class TestReadBins:
    @pytest.mark.parametrize(("module", "name"), TABLES)
    def test_reads_the_table_diffusers_holds(self, module: str, name: str) -> None:
        """Each table read from the source equals, in order, the one diffusers' module holds."""
        theirs = getattr(importlib.import_module(module), name)
        ours = read_bins(module, name)
        assert list(ours.items()) == list(theirs.items())

    @pytest.mark.parametrize(
        "source",
        [
            "OTHER_BIN = {'1.0': [256.0, 256.0]}\n",
            "from elsewhere import ASPECT_RATIO_TEST_BIN\n",
            "ASPECT_RATIO_TEST_BIN = make_bins()\n",
            "def bins():\n    ASPECT_RATIO_TEST_BIN = {'1.0': [256.0, 256.0]}\n",
        ],
        ids=["absent", "imported", "computed", "not-at-the-top"],
    )
    def test_a_moved_table_is_named_with_the_fix(
        self, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A module that no longer assigns the table a literal at its top is an error naming
        the table, the module's file and the fix."""
        monkeypatch.syspath_prepend(tmp_path)
        module = moved(tmp_path, source)
        with pytest.raises(BinsNotFound) as err:
            read_bins(module, "ASPECT_RATIO_TEST_BIN")
        assert str(err.value) == (
            "diffusers' aspect-ratio bins ASPECT_RATIO_TEST_BIN are not a dict literal at the "
            f"top of moved_bins.pipeline ({tmp_path / 'moved_bins' / 'pipeline.py'}), where "
            "PixArt's recipes read them: this diffusers moved them; install the diffusers "
            "version the project was tested with (pip install 'pipeline-lifecycle[diffusers]')"
        )

    def test_a_module_not_installed_is_named(self) -> None:
        """A module with no source on the import path is an error saying so."""
        with pytest.raises(BinsNotFound, match=r"top of no_such_package\.pipeline \(no source"):
            read_bins("no_such_package.pipeline", "ASPECT_RATIO_TEST_BIN")


class TestNearestBin:
    @pytest.mark.parametrize(("module", "name"), TABLES)
    def test_equals_diffusers_classification(self, module: str, name: str) -> None:
        """Every size of a wide grid, tall to wide, falls in the bin diffusers' own
        ``classify_height_width_bin`` picks, for every table."""
        from diffusers.image_processor import PixArtImageProcessor

        table = getattr(importlib.import_module(module), name)
        bins = read_bins(module, name)
        ours = {(h, w): nearest_bin(h, w, bins) for h in SIDES for w in SIDES}
        theirs = {
            (h, w): PixArtImageProcessor.classify_height_width_bin(h, w, table)
            for h in SIDES
            for w in SIDES
        }
        assert ours == theirs

    def test_a_recipe_bins_without_diffusers_pipelines(
        self, pipeline_folder: PipelineFolders
    ) -> None:
        """A PixArt recipe bins a size with neither diffusers' PixArt pipeline modules nor
        transformers' models imported (a fresh process)."""
        result = run_python(BINNING, pipeline_folder("pixart-sigma"), *HEAVY, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "(208, 304) []\n"
