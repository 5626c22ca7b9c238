"""Rows leaving a batch between steps (``Batch.stepped`` and ``Batch.drop_cancelled``)."""

from __future__ import annotations

import pytest
import torch

from components.batch import Batch, Cancelled, Left, StepDone


def batch_of(size: int) -> Batch:
    """Return a batch of ``size`` rows whose per-row values name their row."""
    return Batch(
        generator=torch.Generator().manual_seed(0),
        size=size,
        prompts=[f"p{i}" for i in range(size)],
        context=[torch.full((2, 3), float(i)) for i in range(size)],
        latents=[torch.full((4, 2), float(i)) for i in range(size)],
        negative_prompts=[f"n{i}" for i in range(size)],
        images=torch.arange(size, dtype=torch.float32)[:, None, None, None].expand(size, 3, 2, 2),
    )


class TestDropCancelled:
    def test_nothing_cancelled_keeps_every_row(self) -> None:
        """With nothing cancelled the batch is untouched and None says so."""
        batch = batch_of(3)
        assert batch.drop_cancelled() is None
        assert batch.rows == [0, 1, 2]
        assert batch.left == []

    def test_cancelled_rows_leave_every_per_row_field(self) -> None:
        """Cancelled rows leave prompts, context, latents, negatives and images; order stays."""
        batch = batch_of(4)
        batch.stage, batch.step = "denoise", 2
        batch.cancellation.cancel("job-b", [1, 2])
        assert batch.drop_cancelled() == [0, 3]
        assert batch.rows == [0, 3]
        assert batch.size == 2
        assert batch.prompts == ["p0", "p3"]
        assert batch.negative_prompts == ["n0", "n3"]
        assert [float(c[0, 0]) for c in batch.context or []] == [0.0, 3.0]
        assert [float(x[0, 0]) for x in batch.latents or []] == [0.0, 3.0]
        assert batch.images is not None
        assert batch.images[:, 0, 0, 0].tolist() == [0.0, 3.0]
        assert batch.left == [Left("job-b", (1, 2), "denoise", 2)]

    def test_mixed_sizes_leave_with_their_rows(self) -> None:
        """A batch of mixed sizes drops a cancelled row's size and its image from the lists."""
        batch = batch_of(3)
        batch.image_sizes = [(16, 16), (16, 32), (32, 16)]
        batch.images = [
            torch.full((3, *size), float(i)) for i, size in enumerate(batch.image_sizes)
        ]
        batch.cancellation.cancel("job-b", [1])
        assert batch.drop_cancelled() == [0, 2]
        assert batch.image_sizes == [(16, 16), (32, 16)]
        assert [float(image[0, 0, 0]) for image in batch.images] == [0.0, 2.0]

    def test_later_cancellations_name_original_rows(self) -> None:
        """After rows left, a cancellation still names rows as the batch first had them."""
        batch = batch_of(4)
        batch.cancellation.cancel("a", [0])
        batch.drop_cancelled()
        batch.cancellation.cancel("c", [2])
        assert batch.drop_cancelled() == [0, 2]  # positions among rows 1, 2, 3
        assert batch.rows == [1, 3]

    def test_no_row_left_raises_cancelled(self) -> None:
        """When every row is cancelled the batch raises Cancelled with the stage and step."""
        batch = batch_of(2)
        batch.stage, batch.step = "decode", 0
        batch.cancellation.cancel("whole")
        with pytest.raises(Cancelled) as stopped:
            batch.drop_cancelled()
        assert (stopped.value.stage, stopped.value.step) == ("decode", 0)
        assert batch.left == [Left("whole", (0, 1), "decode", 0)]


class TestStepped:
    def test_reports_each_step_then_drops(self) -> None:
        """stepped counts the step, reports the rows and latents, then drops cancelled rows."""
        batch = batch_of(3)
        heard: list[StepDone] = []
        batch.on_step = heard.append
        latents = [torch.zeros(4, 2)] * 3
        assert batch.stepped(latents) is None
        batch.cancellation.cancel("x", [1])
        assert batch.stepped(latents) == [0, 2]
        assert [(d.step, d.steps, d.rows) for d in heard] == [(1, 4, (0, 1, 2)), (2, 4, (0, 1, 2))]
        assert batch.rows == [0, 2]
