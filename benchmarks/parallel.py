"""Measure what the DiT's parallel layouts send, and 2 processes against 1 (issue 11).

1. Bytes per DiT block and per denoising step, for each sequence-parallel mode and CFG
   parallel, counted by the code (``attention.distributed.count_traffic``, which every
   collective of the split DiT reports to) on real gloo ranks, side by side with the
   formula. Per rank, float32 (b = 4), T packed tokens (padded to the shard count), E
   model width, P sequence ranks, C latent channels:

   - Ulysses: q, k, v out and the output back, each keeping 1/P: ``4 T E b (P-1) / P^2``;
   - ring: the K/V block passed on P - 1 times: ``2 T E b (P-1) / P``;
   - K/V gather: the K/V block sent to P - 1 ranks: ``2 T E b (P-1) / P``;
   - Ulysses U x ring R: ``4 T E b (U-1) / (U^2 R)`` + ``2 T E b (R-1) / (U R)``;
   - per step, all of them gather the output rows once: ``T C b (P-1) / P``;
   - CFG parallel, per step: one rank's predictions: ``T C b``.

   Tensor parallel's all-reduces are DTensor's and not counted here; by formula a block
   all-reduces its attention and MLP outputs, ``2 x 2 T E b (tp-1) / tp`` per rank.
2. Wall time of one DiT step on 2 ranks (Ulysses, ring, K/V gather; CFG parallel
   against both branches in one process) against 1 process, measured in the same run,
   one thread a rank (this machine's 2 cores are shared: read the ratios, not the ms).
3. What it means on GPUs: per block, the bytes a rank sends per attention FLOP it
   computes (``4 S^2 E / P`` FLOPs), at S = 16k and 64k, E = 3072 (bf16, b = 2), P = 8.

Run: ``python -m benchmarks.parallel``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from attention.distributed import count_traffic
from components.kinds.tiny_dit import TinyDit, TinyDitLoader, TinyDitOptions
from components.layout import ParallelLayout
from components.mesh import ParallelMesh
from lifecycle.logs import configure_logging

OPTIONS = TinyDitOptions(dim=64, heads=4, layers=2, ffn_dim=128, seed=5)
TOKENS = (600, 423)  # two requests, 1023 tokens: padded to 1024 on 2 or 4 ranks
STEP_ROUNDS = 5
B = 4  # float32


class Count(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What rank 0 sent in one step of one layout, and how long the step took."""

    sent: dict[str, int]
    seconds: list[float]


LAYOUTS: dict[str, ParallelLayout] = {
    "ulysses 2": ParallelLayout(sp_degree=2, ulysses_degree=2),
    "ring 2": ParallelLayout(sp_degree=2, ring_degree=2),
    "kv_gather 2": ParallelLayout(sp_degree=2, kv_gather_degree=2),
    "ulysses 2 x ring 2": ParallelLayout(sp_degree=4, ulysses_degree=2, ring_degree=2),
    "cfg parallel": ParallelLayout(cfg_parallel=True),
}


def inputs() -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Return the seeded requests of one step."""
    generator = torch.Generator().manual_seed(0)
    latents = [torch.randn(n, OPTIONS.in_channels, generator=generator) for n in TOKENS]
    context = [torch.randn(7, OPTIONS.context_dim, generator=generator) for _ in TOKENS]
    return latents, torch.tensor([500.0, 500.0]), context


def build(layout: ParallelLayout | None) -> tuple[TinyDit, TinyDitLoader]:
    """Build the DiT split by ``layout`` on this rank (whole when None), and its loader."""
    loader = TinyDitLoader(OPTIONS)
    if layout is not None:
        mesh = ParallelMesh(layout, "cpu")
        loader.parallel = mesh.for_component(
            "transformer", sequence_parallel=True, tensor_parallel=True, guidance_parallel=True
        )
    with component_attention_scope(
        ComponentRequests(
            component="transformer", ring=layout is not None and layout.ring_degree > 1
        ),
        platform=Platform("cpu"),
    ):
        module = loader.build("custom")
    arm_layers(module)
    assert isinstance(module, TinyDit)
    return module, loader


def step(module: TinyDit, loader: TinyDitLoader, layout: ParallelLayout | None) -> None:
    """Run one denoising step: both CFG branches under cfg parallel, else one pass."""
    latents, timesteps, context = inputs()
    if layout is not None and layout.cfg_parallel:
        loader.predict_branches(module, latents, timesteps, context, context)
    else:
        module(latents, timesteps, context)


def worker(rank: int, world: int, port: int, name: str, out: str) -> None:
    """Run ``name``'s layout as rank ``rank``; rank 0 writes what it sent and its times."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    configure_logging("json", "error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    layout = LAYOUTS[name]
    module, loader = build(layout)
    with count_traffic() as traffic:
        step(module, loader, layout)
    seconds = []
    for _ in range(STEP_ROUNDS):
        dist.barrier()
        started = time.perf_counter()
        step(module, loader, layout)
        seconds.append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_bytes(msgspec.json.encode(Count(sent=traffic.sent, seconds=seconds)))
    dist.destroy_process_group()


def run_layout(name: str) -> Count:
    """Spawn the ranks of ``name``'s layout and return rank 0's count."""
    world = LAYOUTS[name].world_size
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "count.json")
        context = multiprocessing.get_context("spawn")
        ranks = [
            context.Process(target=worker, args=(rank, world, port, name, out))
            for rank in range(world)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(600)
        return msgspec.json.decode(Path(out).read_bytes(), type=Count)


def formula(name: str) -> tuple[float, float]:
    """Return the formula's bytes per block (attention) and per step (outside blocks)."""
    t, e, c = sum(TOKENS) + (-sum(TOKENS)) % 4, OPTIONS.dim, OPTIONS.in_channels
    layout = LAYOUTS[name]
    p = layout.sp_degree
    gather = t * c * B * (p - 1) / p
    u, r = layout.ulysses_degree, layout.ring_degree
    if name.startswith("ulysses 2 x"):
        return 4 * t * e * B * (u - 1) / (u * u * r) + 2 * t * e * B * (r - 1) / (u * r), gather
    if name.startswith("ulysses"):
        return 4 * t * e * B * (p - 1) / p**2, gather
    if name.startswith(("ring", "kv_gather")):
        return 2 * t * e * B * (p - 1) / p, gather
    return 0.0, sum(TOKENS) * c * B


def main() -> None:
    """Print the bytes table, the wall-time ratios and the GPU projection."""
    torch.set_num_threads(1)
    print(
        f"tiny_dit dim {OPTIONS.dim}, {OPTIONS.heads} heads, {OPTIONS.layers} blocks; "
        f"{len(TOKENS)} requests of {TOKENS} tokens; float32; rank 0's sends\n"
    )
    print(f"{'layout':20} {'per block':>12} {'formula':>12} {'per step':>12} {'formula':>12}")
    alone, loader = build(None)
    times_alone: dict[bool, list[float]] = {False: [], True: []}
    for guided in (False, True):
        for _ in range(STEP_ROUNDS):
            started = time.perf_counter()
            step(alone, loader, ParallelLayout(cfg_parallel=True) if guided else None)
            times_alone[guided].append(time.perf_counter() - started)
    counts = {name: run_layout(name) for name in LAYOUTS}
    for name, count in counts.items():
        outside = count.sent.get("output_gather", 0) + count.sent.get("guidance", 0)
        block = (sum(count.sent.values()) - outside) / OPTIONS.layers
        per_block, per_step = formula(name)
        step_bytes = block * OPTIONS.layers + outside
        step_formula = per_block * OPTIONS.layers + per_step
        print(f"{name:20} {block:12.0f} {per_block:12.0f} {step_bytes:12.0f} {step_formula:12.0f}")
    print(f"\nwall time of one step (median of {STEP_ROUNDS}), this machine, 1 thread a rank")
    one = statistics.median(times_alone[False])
    print(f"  1 process            {one * 1e3:8.1f} ms  (both CFG branches: ", end="")
    print(f"{statistics.median(times_alone[True]) * 1e3:.1f} ms)")
    for name in ("ulysses 2", "ring 2", "kv_gather 2", "cfg parallel"):
        one = statistics.median(times_alone[name == "cfg parallel"])
        two = statistics.median(counts[name].seconds)
        print(f"  2 ranks, {name:12} {two * 1e3:8.1f} ms  ({one / two:.2f}x of 1 process)")
    print("\nGPU projection per block: bytes sent per attention FLOP, E = 3072, bf16, P = 8")
    e, b, p = 3072, 2, 8
    for s in (16_384, 65_536):
        flops = 4 * s * s * e / p
        ulysses = 4 * s * e * b * (p - 1) / p**2
        ring = 2 * s * e * b * (p - 1) / p
        print(
            f"  S = {s:6}: attention {flops / 1e12:6.2f} TFLOP a rank; Ulysses "
            f"{ulysses / 1e6:7.1f} MB ({ulysses / flops:.1e} B/FLOP), ring / K/V gather "
            f"{ring / 1e6:7.1f} MB ({ring / flops:.1e} B/FLOP)"
        )


if __name__ == "__main__":
    main()
