"""The pieces behind ``lifecycle run``'s output: PNG files, neighbours, sizes."""

from __future__ import annotations

import pytest
import torch

from lifecycle.admission.budget import stage_fits
from lifecycle.cli.neighbours import Neighbour, nearest_neighbours
from lifecycle.pictures.png import encode_png
from lifecycle.spec.sizes import format_sizes
from tests.conftest import decode_png


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
