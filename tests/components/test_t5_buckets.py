"""T5's relative position buckets: transformers' values, made once per length."""

from __future__ import annotations

import pytest
import torch

from components.models.t5 import relative_buckets


def test_buckets_equal_transformers() -> None:
    """The buckets of 512 tokens are those transformers' T5 computes (bidirectional)."""
    modeling = pytest.importorskip("transformers.models.t5.modeling_t5")
    position = torch.arange(512)
    relative = position[None, :] - position[:, None]
    theirs = modeling.T5Attention._relative_position_bucket(relative, True, 32, 128)
    assert torch.equal(relative_buckets(512, 32, 128), theirs)


def test_buckets_are_made_once_per_length_outside_inference_mode() -> None:
    """A second encode of a length gets the first one's tensor; made under inference mode,
    it is still an ordinary tensor, which a forward with gradients may index with."""
    with torch.inference_mode():
        first = relative_buckets(37, 32, 128)
    assert relative_buckets(37, 32, 128) is first
    assert not first.is_inference()
    table = torch.nn.Embedding(32, 2)
    assert table(first).requires_grad
