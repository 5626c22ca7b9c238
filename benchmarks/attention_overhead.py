"""Measure what an ``Attention`` layer adds over a direct call of the same kernel (issue 3).

B=1, H=8, D=64, float32 on CPU, S in {128, 1024, 4096}. The layer and the direct call are
timed in alternating rounds (order reversed every round) so that drift hits both alike.
Times are each call's fastest round (as timeit advises: load only adds time); the ratio
is the median over rounds of layer / direct within a round, whose two timings sit next
to each other and share the machine's load. Target: ratio <= 1.03 at S >= 1024.

The run uses one intra-op thread: the layer's overhead is per call, and on a shared
2-core machine a second OpenMP thread waiting on a busy core makes small kernels up to
20x slower and the ratios noise.

Run: ``python -m benchmarks.attention_overhead``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from structlog.testing import capture_logs
from torch.nn.functional import scaled_dot_product_attention

from attention import (
    Attention,
    AttentionRequirements,
    AttentionRole,
    ComponentRequests,
    Platform,
    component_attention_scope,
)
from attention.requirements import NO_REQUIREMENTS
from attention.testing import explicit
from benchmarks._environment import announce

# B batch, H heads, S seq, D head dim

B, H, D = 1, 8, 64
LENGTHS = (128, 1024, 4096)
# Rounds per length, and calls per timed sample: short kernels are batched to beat timer noise.
PLAN = {128: (80, 40), 1024: (24, 1), 4096: (8, 1)}


def interleaved(
    calls: dict[str, Callable[[], object]],
    *,
    rounds: int,
    inner: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Return each call's seconds per call in each round, the calls timed side by side on
    ``clock`` (wall time unless given)."""
    for call in calls.values():
        call()  # warm-up: first-call allocations and kernel selection
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            call = calls[name]
            start = clock()
            for _ in range(inner):
                call()
            samples[name].append((clock() - start) / inner)
    return samples


@contextmanager
def threads(count: int) -> Iterator[None]:
    """Run torch with ``count`` intra-op threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def armed_layer(backend: str, requirements: AttentionRequirements = NO_REQUIREMENTS) -> Attention:
    """Build an armed self-attention layer running ``backend``, its log events swallowed."""
    with (
        capture_logs(),  # keep the selection events out of the printed table
        component_attention_scope(
            ComponentRequests(component="bench", component_backend=explicit(backend)),
            platform=Platform("cpu"),
        ),
    ):
        layer = Attention("self", AttentionRole.SELF, requirements=requirements)
    layer.arm()
    return layer


def main() -> None:
    """Print the overhead table: direct kernel vs Attention layer, per backend and S."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    direct: dict[str, Callable[[torch.Tensor], object]] = {
        "torch_sdpa": lambda q: scaled_dot_product_attention(q, q, q),
        "torch_flash": lambda q: flash(q, q, q, 0.0, False),
    }
    print("## Attention layer vs direct kernel call (CPU, 1 thread, float32, B=1, H=8, D=64)\n")
    print("| backend | S | direct µs (best) | Attention µs (best) | ratio (median) | added µs |")
    print("|---|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode(), threads(1):
        for backend, kernel in direct.items():
            layer = armed_layer(backend)
            for s in LENGTHS:
                q = torch.randn(B, H, s, D, generator=generator)  # (B, H, S, D)
                rounds, inner = PLAN[s]
                times = interleaved(
                    {"direct": partial(kernel, q), "layer": partial(layer, q, q, q)},
                    rounds=rounds,
                    inner=inner,
                )
                fast = {name: min(samples) for name, samples in times.items()}
                ratio = statistics.median(
                    a / b for a, b in zip(times["layer"], times["direct"], strict=True)
                )
                print(
                    f"| {backend} | {s} | {fast['direct'] * 1e6:.1f} | {fast['layer'] * 1e6:.1f} "
                    f"| {ratio:.3f} | {(fast['layer'] - fast['direct']) * 1e6:+.1f} |"
                )
    print()


if __name__ == "__main__":
    announce("attention_overhead")
    main()
