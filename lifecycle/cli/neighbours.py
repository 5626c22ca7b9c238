"""The nearest neighbour of each sentence a run embedded, by cosine similarity."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch

__all__ = ["Neighbour", "nearest_neighbours"]

# S sentences, E embedding width


class Neighbour(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The sentence closest to another one.

    Attributes:
        sentence: the sentence.
        neighbour: the other sentence most similar to it.
        cosine: their cosine similarity, in [-1, 1].
    """

    sentence: str
    neighbour: str
    cosine: float


def nearest_neighbours(embeddings: Mapping[str, torch.Tensor]) -> tuple[Neighbour, ...]:
    """Return, for each sentence, the other one with the highest cosine similarity.

    ``embeddings`` maps each distinct sentence to its ``(E,)`` vector. Fewer
    than two sentences have no neighbours.
    """
    sentences = list(embeddings)
    if len(sentences) < 2:
        return ()
    vectors = torch.stack([embeddings[s].float().cpu() for s in sentences])  # (S, E)
    unit = torch.nn.functional.normalize(vectors, dim=1)
    similarity = unit @ unit.T  # (S, S)
    similarity.fill_diagonal_(-float("inf"))
    best = similarity.argmax(dim=1)
    return tuple(
        Neighbour(
            sentence=sentence,
            neighbour=sentences[int(best[i])],
            cosine=round(float(similarity[i, best[i]]), 4),
        )
        for i, sentence in enumerate(sentences)
    )
