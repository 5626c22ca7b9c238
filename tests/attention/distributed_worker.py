"""The spawn target of the distributed attention tests: every case, run on every rank.

Each case builds the same seeded full q/k/v on every rank, runs a variant on the rank's
shard, gathers the output and compares it with the float32 ``reference`` kernel over the
whole sequence. Outcomes (the error, or the failure text) go to ``rank<r>.json``, so one
spawn of two processes serves the whole test module.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from attention import (
    Attention,
    AttentionRequirements,
    AttentionRole,
    ComponentRequests,
    Platform,
    component_attention_scope,
    registry,
)
from attention.distributed import (
    LocalAttention,
    kv_gather_attention,
    ring_attention,
    ulysses_attention,
)
from attention.testing import RandomInputs, explicit, rel_err, run_dense
from tests.ranks import joined

# B batch, H heads, S seq, D head dim, P ranks in the group

SEED = 20261129
REFERENCE = registry.get("reference").make_impl()

# (B, Hq, Hk, S, D) of the full inputs; S divides by the world size.
Shape = tuple[int, int, int, int, int]
MHA: Shape = (2, 4, 4, 16, 8)
GQA: Shape = (1, 4, 2, 12, 16)
MQA: Shape = (1, 4, 1, 12, 16)

Variant = Callable[..., torch.Tensor]


class Outcome(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Record one case on one rank.

    Attributes:
        rel_err: max|out - ref| / max|ref| of the gathered output, or None when it raised.
        error: ``Type: message`` of what the case raised, or None.
        trace: the traceback of what it raised, for the failure message.
    """

    rel_err: float | None = None
    error: str | None = None
    trace: str | None = None


def layer(backend: str, *, ring: bool = False, causal: bool = False) -> Attention:
    """Build an armed self-attention layer of component 'transformer' running ``backend``."""
    with component_attention_scope(
        ComponentRequests(component="transformer", component_backend=explicit(backend), ring=ring),
        platform=Platform("cpu"),
    ):
        built = Attention(
            "self", AttentionRole.SELF, requirements=AttentionRequirements(causal=causal)
        )
    built.arm()
    return built


def against_reference(
    variant: Variant, attend: LocalAttention, shape: Shape, **kwargs: bool
) -> float:
    """Run ``variant`` on this rank's shard and return the gathered output's error."""
    b, hq, hk, s, d = shape
    q, k, v = RandomInputs(SEED).qkv(b, hq, hk, s, s, d, dtype=torch.float32)
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = slice(rank * s // world, (rank + 1) * s // world)
    out = variant(q[..., shard, :], k[..., shard, :], v[..., shard, :], attend, **kwargs)
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out.contiguous())
    full = torch.cat(parts, dim=-2)  # (B, Hq, S, D)
    ref = run_dense(REFERENCE, q, k, v, causal=kwargs.get("is_causal", False))
    return rel_err(full, ref)


CASES: dict[str, Callable[[], float]] = {
    "ulysses": lambda: against_reference(ulysses_attention, layer("torch_sdpa"), MHA),
    "ulysses_gqa": lambda: against_reference(ulysses_attention, layer("torch_sdpa"), GQA),
    "ulysses_mqa": lambda: against_reference(ulysses_attention, layer("torch_flash"), MQA),
    "ulysses_causal": lambda: against_reference(
        ulysses_attention, layer("torch_sdpa", causal=True), MHA, is_causal=True
    ),
    "ulysses_heads": lambda: against_reference(
        ulysses_attention, layer("torch_sdpa"), (1, 3, 3, 8, 8)
    ),
    "ring_torch_flash": lambda: against_reference(
        ring_attention, layer("torch_flash", ring=True), MHA
    ),
    "ring_reference": lambda: against_reference(ring_attention, REFERENCE, MHA),
    "ring_gqa": lambda: against_reference(ring_attention, layer("torch_flash", ring=True), GQA),
    "ring_causal": lambda: against_reference(
        ring_attention, layer("torch_flash", ring=True, causal=True), MHA, is_causal=True
    ),
    "kv_gather": lambda: against_reference(kv_gather_attention, layer("torch_sdpa"), MHA),
    "kv_gather_gqa": lambda: against_reference(
        kv_gather_attention, registry.get("torch_flash").make_impl(), GQA
    ),
}


def run_cases(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Join the gloo group through ``init_file``, run every case, write this rank's outcomes."""
    outcomes: dict[str, Outcome] = {}
    with joined(rank, world, init_file):
        for name, case in CASES.items():
            try:
                outcomes[name] = Outcome(rel_err=case())
            except Exception as err:  # reported to the parent, which asserts on it
                outcomes[name] = Outcome(
                    error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()
                )
    Path(out_dir, f"rank{rank}.json").write_bytes(msgspec.json.encode(outcomes))
