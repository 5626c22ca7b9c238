"""A text encoder's rows run a micro-batch at a time, cancellations taken between them.

An encoder's stage is one step, so a request cancelled while it ran left the batch only
when the stage ended: a 2048-input embeddings job whose client had gone ran 3.9 s more.
``encode_rows`` runs the rows in balanced micro-batches of at most ``MICRO_BATCH_SLOTS``
padded token slots, and takes the rows cancelled meanwhile out of the batch after each
(``Batch.drop_cancelled``): a cancelled request costs at most the micro-batch in flight,
and a batch left with no row stops there (``Cancelled``).

Every micro-batch keeps the whole batch's padding, so a row attends over the same keys
as in one forward, and the other layers work token by token: each row's result equals
one forward's bit for bit wherever a GEMM computes a row the same whatever the rows
beside it. MKL (AVX-512, measured here on MiniLM's three shapes) does so from 16 rows
on one thread, and from 200 on two and four (under 16 rows it takes another kernel;
on several threads some sizes up to 100 split the sum differently), and a micro-batch
of a typical batch holds hundreds of real tokens (tests/components/test_micro_batches.py
holds one forward and micro-batches equal). One of fewer (short sentences padded to a
long one) may round differently in the last bits (under 6e-6 seen), as a request
batched with others already does against itself alone (serving's 1e-5).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from components.batch import Batch

__all__ = ["encode_rows"]

# B rows, S tokens a row (the batch's padded length), E embedding width

MICRO_BATCH_SLOTS = 1024
"""Padded token slots (rows x S) of one micro-batch: its linear layers run on at most
that many tokens and its attention on rows x S x S scores. 2048 short inputs (S = 16)
make 32 micro-batches: about 0.15 s each where the whole job took 4.9 s, 1.3 s on a
busy 2-core machine (40-45 s). Measured there on 512 of them, one thread, in
alternating rounds: micro-batches of 256, 512, 1024 and 2048 slots took 0.88x, 0.70x,
0.67x and 0.74x the time of one forward (smaller forwards keep their activations in
cache)."""

Encode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""An encoder's forward: token ids ``(B, S)`` and mask ``(B, S)`` to ``(B, S, E)``."""


def micro_batches(rows: int, width: int) -> list[range]:
    """Split ``rows`` rows of ``width`` tokens into balanced runs of at most
    ``MICRO_BATCH_SLOTS`` slots (a row at least), in order."""
    per = max(1, MICRO_BATCH_SLOTS // width)
    count = -(-rows // per)
    bounds = [rows * i // count for i in range(count + 1)]
    return [range(start, end) for start, end in itertools.pairwise(bounds)]


def encode_rows(
    batch: Batch, ids: torch.Tensor, mask: torch.Tensor, encode: Encode
) -> tuple[torch.Tensor, list[int]]:
    """Encode one sentence per row of ``batch`` in micro-batches; return the hidden states
    ``(B', S, E)`` of the rows still in the batch at the end, and their positions among
    the rows it had when called.

    Rows cancelled between micro-batches are taken out of ``batch`` and not computed.

    Raises:
        Cancelled: every row of the batch was cancelled.
    """
    rows = list(batch.rows)  # the original row of each position now
    done: list[int] = []
    parts: list[torch.Tensor] = []
    for run in micro_batches(len(rows), ids.shape[1]):
        staying = set(batch.rows)
        picked = [i for i in run if rows[i] in staying]
        if picked:
            parts.append(encode(ids[picked], mask[picked]))  # (b, S, E)
            done += picked
        batch.drop_cancelled()
    hidden = torch.cat(parts)  # (len(done), S, E)
    staying = set(batch.rows)
    kept = [i for i in range(len(rows)) if rows[i] in staying]
    if kept == done:
        return hidden, kept
    at = {position: index for index, position in enumerate(done)}
    return hidden[[at[i] for i in kept]], kept
