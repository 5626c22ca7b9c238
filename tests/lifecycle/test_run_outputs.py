"""The pieces behind ``lifecycle run``'s output: cores, PNG files, neighbours, sizes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lifecycle.admission.budget import stage_fits
from lifecycle.cli.cores import physical_cores, torch_threads
from lifecycle.cli.neighbours import Neighbour, nearest_neighbours
from lifecycle.png import encode_png
from lifecycle.sizes import format_sizes
from tests.conftest import decode_png


def topology(tmp_path: Path, siblings: dict[int, str]) -> Path:
    """Write a ``/sys/devices/system/cpu`` lookalike: each CPU with its sibling list."""
    for cpu, text in siblings.items():
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


class TestPhysicalCores:
    def test_hyperthreads_of_one_core_count_once(self, tmp_path: Path) -> None:
        """Two SMT siblings on each of two cores make two physical cores."""
        root = topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
        assert physical_cores({0, 1, 2, 3}, root) == 2

    def test_only_the_allowed_cpus_count(self, tmp_path: Path) -> None:
        """CPUs outside the process's affinity add nothing."""
        root = topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
        assert physical_cores({0, 2}, root) == 1

    def test_without_topology_every_cpu_counts(self, tmp_path: Path) -> None:
        """Where SMT cannot be read, each logical CPU counts as a core."""
        assert physical_cores({0, 1, 2}, tmp_path) == 3

    def test_this_machine_has_at_least_one(self) -> None:
        """The process's own cores are at least one and at most its logical CPUs."""
        assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


class TestTorchThreads:
    def test_a_requested_count_wins(self) -> None:
        """``--threads`` is taken as given, for run and serve alike."""
        assert torch_threads(7, processes=4, event_loop=True) == 7

    def test_default_is_the_process_share_of_the_cores(self) -> None:
        """run alone gets every core; the workers of a node split them; serve leaves one."""
        cores = physical_cores()
        assert torch_threads(None) == cores
        assert torch_threads(None, processes=2) == max(1, cores // 2)
        assert torch_threads(None, event_loop=True) == max(1, cores - 1)

    def test_never_below_one(self) -> None:
        """More workers than cores, or one core and an event loop, still get one thread."""
        assert torch_threads(None, processes=4 * physical_cores(), event_loop=True) == 1


class TestEncodePng:
    def test_pixels_round_trip(self) -> None:
        """The PNG holds the image's size and its pixels mapped from [-1, 1] to 0..255."""
        image = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0)) * 2 - 1
        pixels = decode_png(encode_png(image))
        assert pixels.shape == (5, 7, 3)
        expected = ((image + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0)
        assert torch.equal(pixels, expected)

    def test_not_rgb_is_refused(self) -> None:
        """An image without three channels is a clear error."""
        with pytest.raises(ValueError, match=r"expected an RGB image \(3, H, W\), got"):
            encode_png(torch.zeros(1, 4, 4))


class TestNearestNeighbours:
    def test_each_sentence_gets_its_closest_other(self) -> None:
        """Each vector's neighbour is the most similar other one, with its cosine."""
        found = nearest_neighbours(
            {
                "a": torch.tensor([1.0, 0.0]),
                "b": torch.tensor([2.0, 0.2]),
                "c": torch.tensor([0.0, 1.0]),
            }
        )
        assert found[0] == Neighbour(sentence="a", neighbour="b", cosine=0.995)
        assert (found[1].neighbour, found[2].neighbour) == ("a", "b")

    def test_one_sentence_has_no_neighbour(self) -> None:
        """A single sentence has nothing to compare with."""
        assert nearest_neighbours({"a": torch.ones(3)}) == ()


class TestFormatSizes:
    def test_close_sizes_get_more_digits(self) -> None:
        """Two sizes that round alike at one digit are printed with enough to differ."""
        assert format_sizes(248_665, 248_640) == ("242.84 KiB", "242.81 KiB")

    def test_sizes_one_byte_apart_fall_back_to_bytes(self) -> None:
        """When four digits cannot separate them, exact byte counts do."""
        assert format_sizes(2**30, 2**30 + 1) == ("1073741824 B", "1073741825 B")

    def test_equal_and_far_sizes_keep_one_digit(self) -> None:
        """Sizes that already differ, or are equal, keep one digit."""
        assert format_sizes(2048, 2048, 3 * 2**20) == ("2.0 KiB", "2.0 KiB", "3.0 MiB")

    def test_budget_message_sizes_differ(self) -> None:
        """A stage just over its budget says both sizes with the digits that tell them apart."""
        refusal = stage_fits("s", {"a": 248_665}, ("a",), (), 248_640)
        assert refusal is not None
        assert refusal.message == (
            "stage 's' needs 242.84 KiB on device at once (a 242.84 KiB), more than the "
            "242.81 KiB budget"
        )
