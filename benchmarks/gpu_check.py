"""The GPU check (issue 12): ``make gpu-check`` on a machine with a CUDA device.

One bounded run (``BUDGET_S``, under 8 minutes): the ``cuda``-marked tests, then the GPU
variants of the benchmarks, each timed on the device with synchronisation:

- pinned host copies: ``HostStore.onload`` (pinned master, copy stream) against a plain
  ``.to("cuda")`` of pageable copies of the same tensors, in GB/s;
- copy stream overlap: compute then onload, against prefetch, compute, onload;
- prefetch: a layerwise forward streaming blocks from pinned host memory with prefetch
  0, 1 and 2, against the same model resident;
- ``flash_attn`` and CUDA ``torch_flash``: an ``Attention`` layer against a direct
  ``scaled_dot_product_attention`` call, fp16, B=1, H=8, D=64, S in 1024 and 4096;
- encoders: the ``archs`` comparisons of our T5, CLIP and VAE against the libraries'
  classes, on CUDA in bfloat16 (``benchmarks._archs_encoders``).

Every figure, every test count and every error goes to one JSON file: ``$OUT/gpu-check.json``
when ``OUT`` is set, else ``.lifecycle/gpu-check.json``. A variant that fails records its
error and the others still run; the exit status is 1 when a test or a variant failed.
Without CUDA the check refuses at once (exit 2) and says why. In the benchmark suite
(``python -m benchmarks``) each variant prints one line saying it was skipped on CPU.

Run: ``make gpu-check`` (or ``python -m benchmarks.gpu_check``).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from structlog.testing import capture_logs
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from attention import (
    Attention,
    AttentionRole,
    ComponentRequests,
    Platform,
    component_attention_scope,
    registry,
)
from attention.testing import explicit
from benchmarks._archs_encoders import ENCODERS
from components.offload import HostStore, LayerwiseStore

# B batch, H heads, S seq, D head dim

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 450.0  # the whole check; leaves room under the 8 minutes of issue 12
TESTS_BUDGET_S = 240.0
WIDTH, BLOCKS = 2048, 12  # 16 MiB per fp32 block
H, D = 8, 64
LENGTHS = (1024, 4096)

Figures = dict[str, Any]


def output_path() -> Path:
    """Return where the JSON goes: under ``$OUT`` when set, else ``.lifecycle/``."""
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / ".lifecycle"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "gpu-check.json"


def cuda_time(call: Callable[[], object], repeats: int = 5) -> float:
    """Return the median seconds of ``call`` on the device, synchronised, after a warm-up."""
    call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


class Stack(nn.Module):
    """A stack of linear blocks: what layerwise offload streams."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
        with torch.no_grad():
            for block in self.blocks:
                block.weight.normal_(std=WIDTH**-0.5, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every block on ``x`` ``(B, WIDTH)``."""
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def pinned_copies() -> Figures:
    """Onload bandwidth of the pinned host store against pageable ``.to('cuda')`` copies."""
    model = Stack()
    pageable = [p.detach().clone() for p in model.parameters()]
    store = HostStore(model, "cuda")

    def store_round_trip() -> None:
        store.onload()
        torch.cuda.synchronize()
        store.offload()

    pinned_s = cuda_time(store_round_trip)
    plain_s = cuda_time(lambda: [t.to("cuda") for t in pageable])
    store.close()
    return {
        "bytes": store.nbytes,
        "pinned_store_gb_s": store.nbytes / pinned_s / 1e9,
        "pageable_to_cuda_gb_s": store.nbytes / plain_s / 1e9,
        "pinned_vs_pageable": plain_s / pinned_s,
    }


def copy_stream_overlap() -> Figures:
    """Compute then onload, against a prefetch on the copy stream that overlaps the compute."""
    model = Stack()
    store = HostStore(model, "cuda")
    a = torch.randn(4096, 4096, device="cuda")

    def compute() -> None:
        for _ in range(8):
            a.matmul(a)

    def sequential() -> None:
        compute()
        store.onload()
        torch.cuda.synchronize()
        store.offload()

    def overlapped() -> None:
        store.prefetch()
        compute()
        store.onload()
        torch.cuda.synchronize()
        store.offload()

    figures = {
        "compute_s": cuda_time(compute),
        "sequential_s": cuda_time(sequential),
        "overlapped_s": cuda_time(overlapped),
    }
    figures["overlap_speedup"] = figures["sequential_s"] / figures["overlapped_s"]
    store.close()
    return figures


def layerwise_prefetch() -> Figures:
    """A forward streaming blocks from pinned host memory, per prefetch distance, vs resident."""
    x = torch.randn(64, WIDTH, device="cuda")
    resident = Stack().cuda()
    with torch.inference_mode():
        figures: Figures = {"resident_s": cuda_time(lambda: resident(x))}
        for prefetch in (0, 1, 2):
            model = Stack()
            store = LayerwiseStore(
                model, model.blocks, target="host", device="cuda", prefetch=prefetch, resident=True
            )
            figures[f"prefetch_{prefetch}_s"] = cuda_time(lambda m=model: m(x))
            store.close()
    for prefetch in (0, 1, 2):
        figures[f"prefetch_{prefetch}_vs_resident"] = (
            figures[f"prefetch_{prefetch}_s"] / figures["resident_s"]
        )
    return figures


def attention_layer(backend: str) -> Figures:
    """An ``Attention`` layer on ``backend`` against a direct SDPA call, fp16, per length."""
    reason = registry.get(backend).unavailable_reason("cuda")
    if reason is not None:
        return {"skipped": reason}  # e.g. flash_attn does not import on this machine
    with (
        capture_logs(),
        component_attention_scope(
            ComponentRequests(component="gpu-check", component_backend=explicit(backend)),
            platform=Platform("cuda"),
        ),
    ):
        layer = Attention("self", AttentionRole.SELF)
    layer.arm()
    generator = torch.Generator(device="cuda").manual_seed(0)
    figures: Figures = {}
    with torch.inference_mode():
        for s in LENGTHS:
            q = torch.randn(1, H, s, D, device="cuda", dtype=torch.float16, generator=generator)
            ours = layer(q, q, q)  # (B, H, S, D)
            direct = scaled_dot_product_attention(q, q, q)
            figures[f"S{s}_max_abs_diff"] = float((ours - direct).abs().max())
            figures[f"S{s}_layer_s"] = cuda_time(lambda q=q: layer(q, q, q), repeats=20)
            figures[f"S{s}_direct_sdpa_s"] = cuda_time(
                lambda q=q: scaled_dot_product_attention(q, q, q), repeats=20
            )
            figures[f"S{s}_direct_vs_layer"] = (
                figures[f"S{s}_direct_sdpa_s"] / figures[f"S{s}_layer_s"]
            )
    return figures


def encoders() -> Figures:
    """Each ``archs`` encoder pair on CUDA in bfloat16: both times, their ratio, the error."""
    figures: Figures = {}
    with tempfile.TemporaryDirectory() as scratch:
        for key, build in ENCODERS.items():
            pair = build(Path(scratch) / key, torch.device("cuda"), torch.bfloat16)
            with torch.inference_mode():
                ours_s, theirs_s = cuda_time(pair.ours), cuda_time(pair.theirs)
                figures[key] = {
                    "ours_s": ours_s,
                    "theirs_s": theirs_s,
                    "ours_vs_theirs": ours_s / theirs_s,
                    "max_rel_error": pair.error(),
                }
    return figures


VARIANTS: dict[str, Callable[[], Figures]] = {
    "pinned_host_copies": pinned_copies,
    "copy_stream_overlap": copy_stream_overlap,
    "layerwise_prefetch": layerwise_prefetch,
    "flash_attn": lambda: attention_layer("flash_attn"),
    "torch_flash_cuda": lambda: attention_layer("torch_flash"),
    "encoders": encoders,
}


def cuda_tests(budget_s: float) -> Figures:
    """Run the ``cuda``-marked tests; return their counts, or the reason they did not run."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "cuda-tests.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
        ]
        try:
            done = subprocess.run(
                command, cwd=ROOT, capture_output=True, text=True, timeout=budget_s
            )
        except subprocess.TimeoutExpired:
            return {"ran": False, "error": f"the cuda tests ran past {budget_s:.0f} s"}
        counts: dict[str, str] = {}
        if report.exists():
            root = ElementTree.parse(report).getroot()
            suite = root.find("testsuite")
            counts = dict((root if suite is None else suite).attrib)
        return {
            "ran": True,
            "exit_status": done.returncode,
            "tests": int(counts.get("tests", 0)),
            "failures": int(counts.get("failures", 0)) + int(counts.get("errors", 0)),
            "skipped": int(counts.get("skipped", 0)),
            "summary": done.stdout.strip().splitlines()[-1:] or [""],
        }


def check() -> int:
    """Run the whole check on CUDA and write the JSON; return the exit status."""
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none: a CPU-only build"
        print(
            f"gpu-check needs a CUDA device: torch {torch.__version__} (CUDA {build}) sees "
            "none. Run it on a machine with a GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    result: Figures = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "tests": cuda_tests(TESTS_BUDGET_S),
        "figures": {},
        "errors": {},
    }
    for name, variant in VARIANTS.items():
        if time.perf_counter() - started > BUDGET_S - 60:
            result["errors"][name] = "skipped: the check's time budget is spent"
            continue
        try:
            result["figures"][name] = variant()
        except Exception as err:  # one broken variant must not lose the others' figures
            result["errors"][name] = f"{type(err).__name__}: {err}"
        torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - started, 1)
    path = output_path()
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"gpu-check: figures written to {path}", file=sys.stderr)
    failed = result["errors"] or result["tests"].get("failures") or not result["tests"]["ran"]
    return 1 if failed else 0


def main() -> None:
    """In the benchmark suite: run the GPU variants where CUDA is, else say each was skipped."""
    if not torch.cuda.is_available():
        for name in VARIANTS:
            print(f"{name}: skipped, no CUDA device here (run `make gpu-check` on a GPU)")
        print()
        return
    for name, variant in VARIANTS.items():
        print(f"{name}: {json.dumps(variant())}")
    print()


if __name__ == "__main__":
    sys.exit(check())
