"""Measure the NaN/Inf scan of weights files against the load it is part of (issue 10).

``load_weights`` reads every tensor of a safetensors file, scans the floating ones for
NaN and infinity, and copies them into the module. This times the whole load of the
MiniLM checkpoint (22.7 M float32 weights, about 90 MB), the whole build of its custom
path (construct, then load_weights) and, in the same rounds, the scan alone on the same
tensors; the figures are medians over rounds of scan / load and scan / build. The page
cache is warm after the first round, so the load is the cheapest it gets and the
fraction the largest.

Run: ``python -m benchmarks weights_scan``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.attention_overhead import interleaved, threads
from components.kinds.minilm_text_encoder import MiniLmLoader
from components.weights import load_weights, nonfinite

ROUNDS = 9


def main() -> None:
    """Print the load time, the scan time and the scan's fraction of the load."""
    loader = MiniLmLoader.from_options({})
    if loader.options.weights is None:
        print("skipped: the MiniLM weights package is not installed")
        return
    path = Path(loader.options.weights)
    module = loader.build("custom")
    tensors = module.state_dict()
    with threads(1):
        samples = interleaved(
            {
                "build": lambda: loader.build("custom"),
                "load": lambda: load_weights(module, path),
                "scan": lambda: nonfinite(tensors),
            },
            rounds=ROUNDS,
            inner=1,
        )
    ratios = [s / t for s, t in zip(samples["scan"], samples["load"], strict=True)]
    of_build = [s / t for s, t in zip(samples["scan"], samples["build"], strict=True)]
    build, load, scan = (statistics.median(samples[k]) * 1e3 for k in ("build", "load", "scan"))
    print("| what (one thread, warm page cache) | median |\n|---|---|")
    print(f"| build: construct + load_weights, MiniLM custom path | {build:.1f} ms |")
    print(f"| load_weights (read + scan + copy), MiniLM | {load:.1f} ms |")
    print(f"| NaN/Inf scan alone, same tensors | {scan:.1f} ms |")
    print(f"| scan / load_weights (median of per-round ratios) | {statistics.median(ratios):.1%} |")
    print(f"| scan / build (median of per-round ratios) | {statistics.median(of_build):.1%} |")
