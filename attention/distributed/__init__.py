"""Distributed attention over a process group (design §4.5): Ulysses, ring, K/V gather.

Each variant takes this rank's shard of q, k and v along the sequence and a local
attention layer or kernel, and returns this rank's shard of the output, equal to
attention over the whole sequence. They run on ``torch.distributed`` (gloo on CPU, NCCL
on GPU) and need an initialised process group.
"""

from __future__ import annotations

from attention.distributed.kv_gather import kv_gather_attention
from attention.distributed.local import LocalAttention, LocalKernel
from attention.distributed.packed import packed_sequence_attention
from attention.distributed.ring import ring_attention
from attention.distributed.traffic import Traffic, count_traffic
from attention.distributed.ulysses import ulysses_attention

__all__ = [
    "LocalAttention",
    "LocalKernel",
    "Traffic",
    "count_traffic",
    "kv_gather_attention",
    "packed_sequence_attention",
    "ring_attention",
    "ulysses_attention",
]
