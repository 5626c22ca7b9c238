"""``compile``: a component's forward compiled by torch.compile (inductor) (design §17).

- ``blocks``: each block of the component's block stack is compiled; blocks of one class
  share one compiled code (regional compilation, diffusers' ``compile_repeated_blocks``);
- ``whole``: the module's forward is compiled as one.

On a CPU device inductor writes C++ and builds it with the compiler ``CXX`` names (else
``g++``) found on ``PATH``. ``compiler_problem`` asks whether that compiler builds a
trivial file, once per process and compiler, without compiling any model.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

__all__ = [
    "DISTRIBUTION_PACKAGE",
    "Compilation",
    "CompileMode",
    "compile_module",
    "compiler_problem",
]

CompileMode: TypeAlias = Literal["off", "blocks", "whole"]
DEFAULT_CXX = "g++"
"""What inductor runs when ``CXX`` is not set (torch._inductor.config.cpp.cxx)."""
DISTRIBUTION_PACKAGE = "g++"
"""The Debian (and Ubuntu) package of the compiler inductor runs by default."""
_PROBE = "#include <cmath>\nint main() { return static_cast<int>(std::sqrt(0.0)); }\n"
_PROBE_SECONDS = 60.0


def compiler_problem() -> str | None:
    """Say why inductor cannot build C++ here (CPU), or None when it can.

    Reads ``CXX`` and ``PATH`` now; the build itself runs once per compiler and ``PATH``.
    """
    cxx = os.environ.get("CXX")
    return _probe(cxx or DEFAULT_CXX, os.environ.get("PATH", ""), from_env=bool(cxx))


@functools.cache
def _probe(cxx: str, path: str, *, from_env: bool) -> str | None:
    named = f"the C++ compiler {cxx!r} (" + (
        "from CXX)" if from_env else "inductor's default; CXX is not set)"
    )
    found = shutil.which(cxx, path=path)
    if found is None:
        return f"{named} was not found" + ("" if "/" in cxx else " on PATH")
    with tempfile.TemporaryDirectory(prefix="lifecycle-cxx-") as folder:
        source = Path(folder) / "probe.cpp"
        source.write_text(_PROBE)
        try:
            done = subprocess.run(
                [found, str(source), "-o", str(Path(folder) / "probe")],
                capture_output=True,
                text=True,
                timeout=_PROBE_SECONDS,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{named} at {found} could not build a one-line C++ file ({err})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"{named} at {found} could not build a one-line C++ file ({last})"
    return None


@dataclass
class Compilation:
    """What torch.compile did for one component: graphs compiled, when, and how long.

    Every graph dynamo hands to inductor is counted: those of the component's first
    forward are its compile, every one after is a recompile (a new shape class, a guard
    that failed). ``seconds`` is the time inductor spent building them.
    """

    mode: CompileMode
    graphs: int = 0
    recompiles: int = 0
    seconds: float = 0.0
    calls: int = 0

    def backend(
        self, graph: torch.fx.GraphModule, inputs: list[torch.Tensor]
    ) -> Callable[..., Any]:
        """Compile ``graph`` with inductor, counting it (torch.compile's ``backend``)."""
        from torch._inductor.compile_fx import compile_fx

        started = time.perf_counter()
        compiled: Callable[..., Any] = compile_fx(graph, inputs)  # type: ignore[assignment]
        self.seconds += time.perf_counter() - started
        self.graphs += 1
        if self.calls > 1:
            self.recompiles += 1
        return compiled

    def count_call(self, *hook_args: object) -> None:
        """A forward pre-hook of the component: one more forward began (None: inputs kept)."""
        self.calls += 1


def compile_module(
    module: nn.Module, mode: CompileMode, blocks: nn.ModuleList | None
) -> Compilation | None:
    """Compile ``module`` in place as ``mode`` asks; return what counts its compiles.

    ``blocks`` is the block stack (``blocks`` compiles each of them: one compiled code per
    block class, since dynamo caches by the code of ``forward``). Nothing compiles yet:
    inductor builds at the first forward of each shape class (a warm-up request).
    The module stays the same object; ``nn.Module.compile`` compiles its ``__call__``.

    Raises:
        ValueError: ``blocks`` mode without a block stack (admission refuses it first).
    """
    if mode == "off":
        return None
    compilation = Compilation(mode)
    if mode == "whole":
        # the forward, not __call__: the counting hook below stays outside the graph
        module.forward = torch.compile(module.forward, backend=compilation.backend)
    elif blocks is None:
        raise ValueError('compile = "blocks" needs a block stack; the kind declares none')
    else:
        for block in blocks:
            block.compile(backend=compilation.backend)
    module.register_forward_pre_hook(compilation.count_call)
    return compilation
