"""What every benchmark pins and prints first: its thread count, the torch version, the date.

One intra-op thread by default: on a shared 2-core machine a second OpenMP thread waiting
on a busy core turns small kernels into noise. ``BENCH_THREADS=N`` pins another count.
"""

from __future__ import annotations

import datetime
import os

import torch

THREADS_VARIABLE = "BENCH_THREADS"


def pin_threads() -> int:
    """Set torch's intra-op thread count from ``BENCH_THREADS`` (default 1); return it."""
    threads = int(os.environ.get(THREADS_VARIABLE, "1"))
    torch.set_num_threads(threads)
    return threads


def announce(title: str) -> None:
    """Pin the threads, then print ``title`` and the run's environment line."""
    threads = pin_threads()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"## {title}\n")
    print(
        f"{threads} intra-op thread{'s' if threads > 1 else ''} ({THREADS_VARIABLE}), "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {now}\n",
        flush=True,
    )
