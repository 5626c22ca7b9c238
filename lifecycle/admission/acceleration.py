"""Refuse a compile mode or a quantization that nothing here would back (design §17).

Both are explicit component options: honoured on every path that admits them, or
refused here with the fix, never dropped. Quantization needs torchao, and whole weights
(no tensor-parallel or FSDP shards); compiling needs a C++ compiler on a CPU device
(probed on a one-line file, never on the model), a block stack for ``blocks``, kernels
dynamo can trace for ``whole``, and a component no layout splits.

The quantized bytes are sized here too (``size_quantized``): from the shapes of the
linear layers of the module built on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from attention import Platform, Provenance
from attention import registry as backends
from components.compile import DISTRIBUTION_PACKAGE, compiler_problem
from components.loader import ComponentLoader, LoaderPath
from components.quantize import EXTRA, missing_package, quantized_bytes
from components.random_fills import built_on_meta
from lifecycle.plan import SitePlan
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["acceleration_refusals", "size_quantized"]


def size_quantized(loader: ComponentLoader, construct: Callable[[], nn.Module]) -> None:
    """Set ``loader.quantized_saving`` from its module's linear layers, built on meta.

    A module that cannot be built is refused by the checks that build it; its size
    stays the declared one.
    """
    loader.quantized_saving = 0
    if loader.quantization == "off":
        return
    try:
        module = built_on_meta(construct)
    except Exception:  # a kind's own code: the residency check names what it raised
        return
    plain, quantized = quantized_bytes(module, loader.dtype, loader.quantization)
    loader.quantized_saving = plain - quantized


def acceleration_refusals(
    spec: PipelineSpec,
    loaders: Mapping[str, ComponentLoader],
    paths: Mapping[str, LoaderPath | None],
    attention: Mapping[str, tuple[SitePlan, ...]],
    platform: Platform,
) -> list[Refusal]:
    """Refuse every component whose compile mode or quantization cannot be backed here.

    ``paths`` are the admitted loading paths (None: refused already) and ``attention``
    each component's planned sites.
    """
    found: list[Refusal] = []
    for name, loader in loaders.items():
        if paths.get(name) is None:
            continue
        found += _quantization_refusals(name, loader, spec)
        found += _compile_refusals(name, loader, spec, attention.get(name, ()), platform)
    return found


def _quantization_refusals(name: str, loader: ComponentLoader, spec: PipelineSpec) -> list[Refusal]:
    quantization = loader.quantization
    if quantization == "off":
        return []
    found = []
    missing = missing_package()
    if missing is not None:
        found.append(
            Refusal(
                code=RefusalCode.MISSING_PACKAGE,
                component=name,
                message=f"component '{name}' asks for quantization = \"{quantization}\", "
                f"which torchao does, but {missing}",
                hint=f"pip install 'pipeline-lifecycle[{EXTRA}]', or remove "
                f"components.{name}.quantization",
            )
        )
    sharded = _weight_splits(name, loader, spec)
    if sharded:
        found.append(
            Refusal(
                code=RefusalCode.QUANTIZED_SPLIT,
                component=name,
                message=f"component '{name}' is quantized ({quantization}), and the layout "
                f"shards its weights ({', '.join(sharded)}): splitting quantized weights "
                "and their scales across ranks is not built",
                hint=f"remove components.{name}.quantization, or run '{name}' whole "
                "(tp_size = 1, not in parallel.fsdp)",
            )
        )
    return found


def _weight_splits(name: str, loader: ComponentLoader, spec: PipelineSpec) -> list[str]:
    """Return the layout settings that shard ``name``'s weights (tensor parallel, FSDP)."""
    layout = spec.parallel
    found = []
    if layout.tp_size > 1 and loader.tensor_parallel:
        found.append(f"tp_size = {layout.tp_size}")
    if name in layout.fsdp:
        found.append("fsdp")
    return found


def _compile_refusals(
    name: str,
    loader: ComponentLoader,
    spec: PipelineSpec,
    sites: tuple[SitePlan, ...],
    platform: Platform,
) -> list[Refusal]:
    mode = loader.compile
    if mode == "off":
        return []
    found = []

    def refuse(code: RefusalCode, message: str, hint: str) -> None:
        found.append(Refusal(code=code, component=name, message=message, hint=hint))

    if platform.kind == "cpu" and (problem := compiler_problem()) is not None:
        refuse(
            RefusalCode.COMPILER_MISSING,
            f"component '{name}' is compiled (compile = \"{mode}\"), and on a CPU device "
            f"inductor builds C++: {problem}",
            f"install a C++ compiler (the {DISTRIBUTION_PACKAGE} package on Debian and "
            f"Ubuntu) or set CXX to one, or remove components.{name}.compile",
        )
    splits = spec.parallel.splits(name) if _is_split(loader, spec, name) else ()
    if splits:
        refuse(
            RefusalCode.NOT_COMPILABLE,
            f"component '{name}' is compiled (compile = \"{mode}\"), and the layout splits "
            f"it across ranks ({', '.join(splits)}): compiling a split component is not built",
            f"remove components.{name}.compile, or run '{name}' whole",
        )
    if mode == "blocks" and (problem := _stack_problem(loader)) is not None:
        refuse(
            RefusalCode.NOT_COMPILABLE,
            f"component '{name}' is compiled by blocks (compile = \"blocks\"), but {problem}",
            f'set components.{name}.compile = "whole"',
        )
    if mode == "whole":
        for site in sites:
            impl = backends.get(site.backend).impl_cls
            if site.provenance is Provenance.EXPLICIT and not impl.traceable:
                refuse(
                    RefusalCode.NOT_COMPILABLE,
                    f"component '{name}' is compiled whole (compile = \"whole\"), and its "
                    f"site '{site.site}' runs the explicit backend '{site.backend}', whose "
                    "kernel dynamo cannot trace",
                    f'set components.{name}.compile = "blocks" (the kernel then runs outside '
                    "the compiled graph), or choose a traceable backend",
                )
    return found


def _is_split(loader: ComponentLoader, spec: PipelineSpec, name: str) -> bool:
    """Tell whether the layout splits ``name`` on this kind (its custom path implements it)."""
    layout = spec.parallel
    return (
        (layout.tp_size > 1 and loader.tensor_parallel)
        or (layout.sp_degree > 1 and loader.sequence_parallel)
        or name in layout.fsdp
    )


def _stack_problem(loader: ComponentLoader) -> str | None:
    if loader.block_stack is None:
        return f"kind '{loader.kind}' declares no block stack to compile block by block"
    return None
