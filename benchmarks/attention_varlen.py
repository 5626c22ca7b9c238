"""Measure packed varlen attention against padding (issue 3).

8 sequences with lengths spread evenly over 64..2048, H=8, D=64, float32 on CPU:
``torch_flash``'s ``forward_varlen`` on the packed ``(T, H, D)`` batch against
``torch_sdpa`` on the batch padded to the longest sequence with a key-padding mask.
The ideal speed-up is the ratio of FLOPs, padded ``N·max(L)²`` over packed ``Σ L²``;
the measured one is timed side by side (see ``benchmarks.attention_overhead``), with one
intra-op thread for the same reason.

Run: ``python -m benchmarks.attention_varlen``.
"""

from __future__ import annotations

from functools import partial

import torch

from attention import AttentionRequirements
from benchmarks._environment import announce
from benchmarks.attention_overhead import armed_layer, interleaved, threads

# B batch, H heads, S seq, D head dim, T packed tokens, N sequences

H, D = 8, 64
LENGTHS = [64 + round(i * (2048 - 64) / 7) for i in range(8)]  # 64 .. 2048
ROUNDS = 5


def main() -> None:
    """Print the varlen table: padded masked SDPA vs packed torch_flash, and the ideal."""
    generator = torch.Generator().manual_seed(0)
    n, longest, total = len(LENGTHS), max(LENGTHS), sum(LENGTHS)
    packed = torch.randn(total, H, D, generator=generator)  # (T, H, D)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    padded = packed.new_zeros(n, H, longest, D)  # (N, H, max L, D)
    keep = torch.zeros(n, 1, 1, longest, dtype=torch.bool)  # key-padding mask
    for i, length in enumerate(LENGTHS):
        padded[i, :, :length] = packed[cu[i] : cu[i + 1]].transpose(0, 1)
        keep[i, ..., :length] = True

    varlen = AttentionRequirements(packed_varlen=True)
    flash = armed_layer("torch_flash", requirements=varlen)
    sdpa = armed_layer("torch_sdpa", requirements=AttentionRequirements(attention_mask=True))
    with torch.inference_mode(), threads(1):
        out_packed = flash.forward_varlen(packed, packed, packed, cu, cu, longest, longest)
        out_padded = sdpa(padded, padded, padded, attn_mask=keep)
        worst = max(
            float(
                (out_padded[i, :, :length].transpose(0, 1) - out_packed[cu[i] : cu[i + 1]])
                .abs()
                .max()
            )
            for i, length in enumerate(LENGTHS)
        )
        times = interleaved(
            {
                "padded": partial(sdpa, padded, padded, padded, attn_mask=keep),
                "packed": partial(
                    flash.forward_varlen, packed, packed, packed, cu, cu, longest, longest
                ),
            },
            rounds=ROUNDS,
            inner=1,
        )
    best = {name: min(samples) for name, samples in times.items()}
    ideal = n * longest**2 / sum(length**2 for length in LENGTHS)
    speedup = best["padded"] / best["packed"]
    print(f"## Packed varlen vs padded masked attention (CPU, 1 thread, lengths {LENGTHS})\n")
    print(
        "| padded torch_sdpa ms | packed torch_flash ms | speed-up | ideal (FLOPs) "
        "| speed-up / ideal | max abs diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {best['padded'] * 1e3:.1f} | {best['packed'] * 1e3:.1f} | {speedup:.2f}x "
        f"| {ideal:.2f}x | {speedup / ideal:.2f} | {worst:.1e} |"
    )
    print()


if __name__ == "__main__":
    announce("attention_varlen")
    main()
