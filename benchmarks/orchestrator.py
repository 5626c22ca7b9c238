"""Admission, loading and serving costs of the orchestrator itself, side by side.

The cost of a move inside a request (issue 12, budget 15 µs) is measured on pipelines of
N = 4, 16, 64 and 256 no-op components, one stage each, every component offloaded to
host after its stage: a request makes 2N moves, and its time over 2N is the cost per
move. The N are timed in interleaved rounds; each figure is a median over rounds of the
thread's CPU time (``time.thread_time``), which the other processes of a shared machine
do not inflate, with the wall time beside it. Timed in the same rounds, for scale: a
plain ``transitions`` trigger (two string states, no guards: the library's floor, and
each move is also given as a multiple of it), the lifecycle machine alone with guards and
work that do nothing (the project's way of driving ``transitions``), and the host
store's own onload + offload of the same no-op module (the part ``components/offload``
owns).

Logging: an unconfigured program, a stdlib ``logging`` handler at info, and JSON lines at
info are each measured in their own process (structlog caches loggers per process),
against a process whose events are all filtered out, in interleaved rounds.

Run: ``python -m benchmarks orchestrator``.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import msgspec
import torch
import transitions
from torch import nn

from attention import Platform
from benchmarks._environment import announce
from components import registry
from components.batch import Batch
from components.loader import ComponentLoader
from components.offload import HostStore
from lifecycle.admission import admit_pipeline
from lifecycle.logs import configure_logging
from lifecycle.machines.component import ComponentLifecycle, LifecycleMachine
from lifecycle.machines.engine import TransitionContext
from lifecycle.machines.tables import GUARDS, Guard
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import Refusal
from lifecycle.spec.reading import decode_spec, load_spec
from lifecycle.spec.structs import PipelineSpec

ROOT = Path(__file__).resolve().parents[1]
CPU = Platform("cpu")
STAGES = ("encode", "denoise", "decode")
WIDTHS = (4, 16, 64, 256)
MOVE_BUDGET_US = 15.0
MOVES_PER_SAMPLE = 2048
"""Moves timed per sample, the same at every N: the first request after another width's
runs on cold caches, and one request of N = 256 (512 moves) per sample measured mostly that."""
LOG_SETUPS = ("filtered out", "unconfigured", "stdlib handler, info", "JSON lines, info")


class NoopLoader(ComponentLoader):
    """A kind whose module does nothing: what remains is the orchestrator's own cost."""

    kind: ClassVar[str] = "bench_noop"

    def build_custom(self) -> nn.Module:
        """Build a module with one small weight and no attention."""
        return nn.Linear(4, 4)

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Do nothing."""


def timed(action: Callable[[], object], repeats: int) -> list[float]:
    """Return the wall time of ``action`` in seconds, ``repeats`` times."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return times


def reference(target: str, offload_dir: Path, resident: bool = False) -> PipelineSpec:
    """Return the reference spec with ``target`` offload, or all components resident."""
    raw = msgspec.to_builtins(load_spec(ROOT / "examples" / "tiny_t2i.toml"))
    raw["memory"].update(offload_target=target, offload_dir=str(offload_dir))
    if resident:
        for component in raw["components"].values():
            component["residency"] = "resident"
    return msgspec.convert(raw, PipelineSpec)


def wide_spec(count: int) -> PipelineSpec:
    """Return a spec of ``count`` components of the reference kinds, one stage each."""
    kinds = ("tiny_text_encoder", "tiny_dit", "tiny_vae", "tiny_upsampler")
    lines = ['name = "wide"']
    for index in range(count):
        lines += [f"[components.c{index}]", f'kind = "{kinds[index % 4]}"']
        lines += ['residency = "component_offload"'] if index % 2 else []
    for index in range(count):
        lines += ["[[stages]]", f'name = "s{index}"', f'uses = ["c{index}"]']
    return decode_spec("\n".join(lines))


def serve(
    orchestrator: Orchestrator, stages: tuple[str, ...], steps: int, batch: Batch | None = None
) -> None:
    """Run one request through ``stages`` (on ``batch``, or a fresh seeded one)."""
    batch = batch or Batch(generator=torch.Generator().manual_seed(0), steps=steps)
    with orchestrator.request() as request:
        for stage in stages:
            request.run(stage, batch)


def noop_spec(count: int, budget: str | None = None) -> PipelineSpec:
    """Return ``count`` no-op components offloaded to host, one stage each."""
    names = [f"c{index}" for index in range(count)]
    return decode_spec(
        'name = "noop"\n'
        + (f'[memory]\ndevice_budget = "{budget}"\n' if budget else "")
        + "".join(
            f'[components.{n}]\nkind = "bench_noop"\nresidency = "component_offload"\n'
            for n in names
        )
        + "".join(f'[[stages]]\nname = "{n}"\nuses = ["{n}"]\n' for n in names)
    )


def plain_transitions() -> Callable[[], object]:
    """Return one round trip of a bare ``transitions`` model: two triggers, no guards."""

    class Model:
        pass

    machine = transitions.Machine(model=None, states=["a", "b"], initial="a")
    model = Model()
    machine.add_model(model)
    machine.add_transition("go", "a", "b")
    machine.add_transition("back", "b", "a")
    return lambda: (model.go(), model.back())  # type: ignore[attr-defined]


def bare_lifecycle() -> Callable[[], object]:
    """Return one onload + offload on a lifecycle machine whose guards and work do nothing.

    What is left is the cost of driving ``transitions`` the lifecycle's way (lock,
    context, every guard, atomic work, logging check), without the orchestrator.
    """

    def passes(context: TransitionContext) -> tuple[Refusal, ...]:
        return ()

    checks = dict.fromkeys((*GUARDS, Guard.PLAN_HONOURED), passes)
    machine = LifecycleMachine()
    component = ComponentLifecycle("bare", checks=checks)
    machine.add_component(component)
    component.admit()
    component.load()
    return lambda: (component.onload(), component.offload())


def move_costs(rounds: int = 15) -> list[tuple[str, float, str]]:
    """Return the cost per move at each width, with and without a budget, and the references."""
    batch = Batch(generator=torch.Generator().manual_seed(0), steps=1)
    calls: dict[str, tuple[Callable[[], object], int]] = {}
    opened = []
    for count in WIDTHS:
        for budget in (None, "1GiB"):
            orchestrator = Orchestrator(noop_spec(count, budget), platform=CPU)
            orchestrator.load()
            opened.append(orchestrator)
            names = tuple(f"c{index}" for index in range(count))
            label = f"N={count}" + (", budget" if budget else "")
            calls[label] = (lambda o=orchestrator, n=names: serve(o, n, 1, batch), 2 * count)
    store = HostStore(NoopLoader.from_options({}).build_custom(), CPU.kind)
    calls["host store onload + offload"] = (lambda: (store.onload(), store.offload()), 2)
    calls["lifecycle machine alone, no-op guards and work"] = (bare_lifecycle(), 2)
    calls["plain transitions trigger"] = (plain_transitions(), 2)
    cpu: dict[str, list[float]] = {label: [] for label in calls}
    wall: dict[str, list[float]] = {label: [] for label in calls}
    for round_ in range(rounds + 1):
        for label, (call, moves) in calls.items():
            repeats = max(1, MOVES_PER_SAMPLE // moves)
            started_cpu, started_wall = time.thread_time(), time.perf_counter()
            for _ in range(repeats):
                call()
            if round_:  # round 0 warms up
                cpu[label].append((time.thread_time() - started_cpu) / repeats / moves)
                wall[label].append((time.perf_counter() - started_wall) / repeats / moves)
    for orchestrator in opened:
        orchestrator.close()
    rows = []
    bare = statistics.median(cpu["plain transitions trigger"])
    for label in calls:
        unit = "us per trigger" if "transitions" in label else "us per move"
        c, w = statistics.median(cpu[label]) * 1e6, statistics.median(wall[label]) * 1e6
        verdict = ""
        if label.startswith("N="):
            verdict = " (within 15 us)" if c <= MOVE_BUDGET_US else " (over the 15 us budget)"
        # the library's own floor, measured in the same rounds: what a move costs beyond it
        ratio = c / (bare * 1e6)
        rows.append(
            (f"{label}: CPU time{verdict}", c, f"{unit}; wall {w:.1f}; {ratio:.2f}x a bare trigger")
        )
    growth = statistics.median(cpu["N=256"]) / statistics.median(cpu["N=4"])
    rows.append(("cost per move at N=256 / at N=4 (CPU time)", growth, "x"))
    return rows


def logging_child(setup: str) -> None:
    """Print the median CPU time of a 4-component request under one logging ``setup``."""
    if setup == "filtered out":
        configure_logging("json", "critical", open(os.devnull, "w"))  # noqa: SIM115
    elif setup == "stdlib handler, info":
        logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))  # noqa: SIM115
    elif setup == "JSON lines, info":
        configure_logging("json", "info", open(os.devnull, "w"))  # noqa: SIM115
    registry.register_kind(NoopLoader)
    names = ("c0", "c1", "c2", "c3")
    batch = Batch(generator=torch.Generator().manual_seed(0), steps=1)
    with Orchestrator(noop_spec(len(names)), platform=CPU) as orchestrator:
        orchestrator.load()
        serve(orchestrator, names, 1, batch)
        samples = []
        for _ in range(200):
            started = time.thread_time()
            serve(orchestrator, names, 1, batch)
            samples.append(time.thread_time() - started)
    print(json.dumps(statistics.median(samples)))


def logging_costs(rounds: int = 3) -> list[tuple[str, float, str]]:
    """Return each logging setup's request time against the filtered-out one."""
    times: dict[str, list[float]] = {setup: [] for setup in LOG_SETUPS}
    for _ in range(rounds):
        for setup in LOG_SETUPS:
            code = f"from benchmarks.orchestrator import logging_child; logging_child({setup!r})"
            done = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
            )
            if done.stdout.count("\n") != 1:
                raise RuntimeError(f"logging setup {setup!r} printed more than its figure")
            times[setup].append(float(done.stdout))
    base = statistics.median(times["filtered out"])
    return [
        (
            f"request of 4 components (8 moves), logging {setup}",
            statistics.median(times[setup]) * 1e6,
            f"us CPU ({statistics.median(times[setup]) / base:.2f}x)",
        )
        for setup in LOG_SETUPS
    ]


def main() -> None:
    """Print admission, load, per-request, per-move and logging figures as a markdown table."""
    registry.register_kind(NoopLoader)
    spec64 = wide_spec(64)
    admission = timed(lambda: admit_pipeline(spec64, CPU), 20)
    rows = [("admit a 64-component pipeline", statistics.median(admission) * 1e3, "ms")]

    def load_reference() -> None:
        with Orchestrator(load_spec(ROOT / "examples" / "tiny_t2i.toml"), platform=CPU) as o:
            o.load()

    load = timed(load_reference, 10)
    rows.append(
        ("load the reference pipeline (admit + build + place)", statistics.median(load) * 1e3, "ms")
    )

    with tempfile.TemporaryDirectory() as folder:
        setups = {
            "all resident": reference("host", Path(folder), resident=True),
            "encoder + VAE offloaded to host": reference("host", Path(folder)),
            "encoder + VAE offloaded to disk": reference("disk", Path(folder)),
        }
        orchestrators = {label: Orchestrator(spec, platform=CPU) for label, spec in setups.items()}
        for orchestrator in orchestrators.values():
            orchestrator.load()
            serve(orchestrator, STAGES, 8)
        samples: dict[str, list[float]] = {label: [] for label in setups}
        for _ in range(15):  # interleaved so that machine noise hits every setup alike
            for label, orchestrator in orchestrators.items():
                samples[label] += timed(lambda o=orchestrator: serve(o, STAGES, 8), 1)
        base = statistics.median(samples["all resident"])
        for label, times in samples.items():
            median = statistics.median(times)
            rows.append((f"request, {label} (8 steps)", median * 1e3, f"ms ({median / base:.2f}x)"))
        for orchestrator in orchestrators.values():
            orchestrator.close()

    batch = Batch(generator=torch.Generator().manual_seed(0), steps=1)
    with Orchestrator(noop_spec(3), platform=CPU) as orchestrator:
        orchestrator.load()
        serve(orchestrator, ("c0", "c1", "c2"), 1, batch)
        overhead = timed(lambda: serve(orchestrator, ("c0", "c1", "c2"), 1, batch), 300)
    rows.append(
        (
            "orchestrator overhead per request (3 stages, 6 moves, no-op modules)",
            statistics.median(overhead) * 1e6,
            "us",
        )
    )
    rows += move_costs()
    registry.unregister_kind(NoopLoader.kind)
    rows += logging_costs()
    print("| measure | value | unit |\n|---|---:|---|")
    for label, value, unit in rows:
        print(f"| {label} | {value:.2f} | {unit} |")


if __name__ == "__main__":
    announce("orchestrator")
    main()
