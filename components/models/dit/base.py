"""What the project's DiTs share: many requests of any size in one forward, and their splits.

A ``PackedTransformer`` takes groups of requests, each group as diffusers' class takes a
batch (one image size, dense tensors), and returns one prediction per group. Inside,
every request of every group is packed into one sequence (``JointLayout``): requests of
different sizes and prompt lengths share the forward, and each output equals the
request run alone. Under a step cache (design §17) the forward hands its requests to
``components.cache.run_cached`` as ``Streams``, and runs the parts of its block stack the
cache asks for (``run_blocks``) on the requests that compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from components.cache import StepCache
from components.mesh import ComponentParallel, SequenceGroups
from components.models.dit.attention import DitAttention
from components.models.dit.streams import StreamStack
from components.tensor_parallel import split_layers

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["PackedTransformer", "TensorPlan", "attention_dims", "regroup"]

Split = Literal["colwise", "rowwise"]
"""How tensor parallel splits one linear layer: by output units (``colwise``, the input
whole on every rank) or by input units (``rowwise``, the partial outputs all-reduced)."""

TensorPlan = dict[str, Split]
"""How tensor parallel splits one block: submodule path -> split."""


class PackedTransformer(StreamStack):
    """A DiT that runs groups of requests packed into one sequence.

    Subclasses implement ``forward(groups, cache)``, ``tensor_plans``, ``depth`` and
    ``run_blocks`` (``StreamStack``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sequence: SequenceGroups | None = None

    def forward(self, groups: Sequence[Any], cache: StepCache | None = None) -> list[torch.Tensor]:
        """Predict for every group of requests: one tensor per group, as diffusers returns it.

        ``cache`` is the step cache's view of this step (one row per request of the
        groups, in order), or None to compute every block.
        """
        raise NotImplementedError

    def tensor_plans(self, shards: int) -> Iterator[tuple[nn.Module, TensorPlan]]:
        """Yield each block with how tensor parallel splits it over ``shards`` ranks."""
        raise NotImplementedError

    def parallelize(self, parallel: ComponentParallel) -> None:
        """Split this DiT over the ranks of ``parallel`` (sequence and tensor parallel).

        Sequence parallel shards the packed joint rows: each attention reaches the other
        shards through ``attention.distributed``, everything else runs on local rows.
        Tensor parallel shards each block's attention by heads and its MLPs by hidden
        units with DTensor (``tensor_plans``); modulation and embeddings stay whole.
        """
        self.sequence = parallel.sequence
        for module in self.modules():
            if isinstance(module, DitAttention):
                module.sequence = parallel.sequence
        if parallel.tensor is None:
            return
        # imported here: torch.distributed.tensor costs ~0.6 CPU-s, which only a process
        # whose layout splits tensors should pay
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        styles: dict[Split, Callable[[], ParallelStyle]] = {
            "colwise": ColwiseParallel,
            "rowwise": RowwiseParallel,
        }
        for block, plan in self.tensor_plans(parallel.tensor.size()):
            split_layers(
                block, parallel.tensor, {path: styles[split]() for path, split in plan.items()}
            )


def attention_dims(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """Return a DiT config's heads, head width and model width (their product)."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config["attention_head_dim"])
    return heads, head_dim, heads * head_dim


def regroup(
    outputs: torch.Tensor, counts: Sequence[int], sizes: Sequence[int]
) -> list[torch.Tensor]:
    """Split packed rows ``(sum N_i, C)`` per request and stack each group: ``(B_g, N_g, C)``.

    ``counts`` are the rows of each request; ``sizes`` the requests of each group.
    """
    rows = list(torch.split(outputs, list(counts)))
    stacked = []
    for size in sizes:
        stacked.append(torch.stack(rows[:size]))
        rows = rows[size:]
    return stacked
