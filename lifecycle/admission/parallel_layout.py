"""Refuse a parallel layout that no component of the pipeline would honour (design §6).

Pure: reads the spec, each component's loader declarations and its admitted loading
path. Every check here runs at admission (``lifecycle check``), before any process
group exists. The layout's own invariants are ``ParallelLayout.check``; the native
path's refusal is ``loader.native_parallel_layout`` in ``lifecycle.admission.loader_path``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from attention import Platform
from components import ParallelLayout, ResidencyMode
from components.loader import ComponentLoader, LoaderPath
from components.sites import AttentionSite
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = [
    "fsdp_refusals",
    "head_refusals",
    "layout_refusals",
    "sharded_offload_refusals",
    "split_refusals",
]


class Split(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One split a layout asks for, and which kinds carry it out.

    Attributes:
        setting: the layout key as written (``tp_size = 2``).
        fix: the same key asking for no split.
        what: what it splits, in words.
        implemented_by: tells whether a kind's custom path carries the split out.
    """

    setting: str
    fix: str
    what: str
    implemented_by: Callable[[ComponentLoader], bool]


def asked_splits(layout: ParallelLayout) -> list[Split]:
    """Return each split of the work across ranks that ``layout`` asks for."""
    splits = []
    if layout.tp_size > 1:
        splits.append(
            Split(
                setting=f"tp_size = {layout.tp_size}",
                fix="tp_size = 1",
                what="heads (tensor parallel)",
                implemented_by=lambda loader: loader.tensor_parallel,
            )
        )
    if layout.sp_degree > 1:
        splits.append(
            Split(
                setting=f"sp_degree = {layout.sp_degree}",
                fix="sp_degree = 1",
                what="sequences",
                implemented_by=lambda loader: loader.sequence_parallel,
            )
        )
    if layout.cfg_parallel:
        splits.append(
            Split(
                setting="cfg_parallel = true",
                fix="cfg_parallel = false",
                what="guidance branches",
                implemented_by=lambda loader: loader.guidance_parallel,
            )
        )
    return splits


def split_refusals(
    spec: PipelineSpec,
    loaders: Mapping[str, ComponentLoader],
    paths: Mapping[str, LoaderPath | None],
) -> list[Refusal]:
    """Return a refusal for each split the layout asks for that no component carries out.

    Tensor and sequence parallel split the custom-path components whose kind implements
    them and replicate the others, so they are refused only when no component's kind
    implements them. A native component under a split layout is already refused for
    that very split (``loader.native_parallel_layout``), so nothing is said here then.
    """
    if spec.parallel.check() or any(path == "native" for path in paths.values()):
        return []  # what the degrees mean is unclear until the invariants hold
    kinds = ", ".join(sorted({component.kind for component in spec.components.values()}))
    return [
        Refusal(
            code=RefusalCode.INVALID_LAYOUT,
            component=spec.name,
            message=f"[parallel] {split.setting} splits {split.what}, but no component of the "
            f"pipeline has a kind that implements it (kinds: {kinds}): every rank would run "
            "the whole model",
            hint=f"set {split.fix}, or add a component whose kind implements {split.what}",
        )
        for split in asked_splits(spec.parallel)
        if not any(split.implemented_by(loader) for loader in loaders.values())
    ]


def fsdp_refusals(
    spec: PipelineSpec,
    loaders: Mapping[str, ComponentLoader],
    paths: Mapping[str, LoaderPath | None],
) -> list[Refusal]:
    """Refuse FSDP for a component it cannot shard.

    Each component FSDP names must be built by a custom path whose kind works sharded,
    not be split by tensor parallel too, and sit in a replica of more than one rank.
    """
    layout = spec.parallel
    if layout.check():
        return []  # the replica's size is unclear until the invariants hold
    replica = layout.world_size // layout.dp_size
    found = []
    for name in sorted(layout.fsdp):
        loader = loaders[name]
        custom = paths[name] == "custom"
        if replica == 1:
            problem = (
                f"FSDP shards '{name}' over the ranks of one replica (cfg x sp x tp), and "
                f"this layout's replica has 1 rank: there is nothing to shard with"
            )
            hint = "raise tp_size, sp_degree or cfg_parallel, or drop it from fsdp"
        elif custom and not loader.fully_shardable:
            problem = (
                f"kind '{loader.kind}' of '{name}' does not declare that its custom path "
                "works sharded by FSDP"
            )
            hint = f"drop '{name}' from [parallel] fsdp"
        elif custom and loader.tensor_parallel and layout.tp_size > 1:
            problem = (
                f"'{name}' is split by tensor parallel (tp_size = {layout.tp_size}); FSDP "
                "over tensor-parallel shards (2-D) is not built"
            )
            hint = f"drop '{name}' from [parallel] fsdp, or set tp_size = 1"
        else:
            continue
        found.append(
            Refusal(code=RefusalCode.INVALID_LAYOUT, component=name, message=problem, hint=hint)
        )
    return found


def sharded_offload_refusals(
    spec: PipelineSpec,
    loaders: Mapping[str, ComponentLoader],
    paths: Mapping[str, LoaderPath | None],
    platform: Platform,
) -> list[Refusal]:
    """Refuse to offload a component whose weights the layout shards, where that cannot run.

    Tensor parallel and FSDP turn a component's weights into DTensor shards. On a CPU
    device with the host target an offload moves nothing (it accounts the local shards);
    writing shards to disk or copying them to pinned host memory is not built.
    """
    if platform.kind == "cpu" and spec.memory.offload_target == "host":
        return []
    layout = spec.parallel
    return [
        Refusal(
            code=RefusalCode.NOT_OFFLOADABLE,
            component=name,
            message=f"'{name}' is {component.residency_mode.value}, and the layout shards its "
            f"weights ({'fsdp' if name in layout.fsdp else f'tp_size = {layout.tp_size}'}): "
            f"offloading DTensor shards to the {spec.memory.offload_target} target on "
            f"{platform.kind} is not built",
            hint=f'set components.{name}.residency = "resident", or use offload_target = '
            '"host" on a CPU device',
        )
        for name, component in spec.components.items()
        if paths[name] == "custom"
        and component.residency_mode is not ResidencyMode.RESIDENT
        and (name in layout.fsdp or (layout.tp_size > 1 and loaders[name].tensor_parallel))
    ]


def layout_refusals(spec: PipelineSpec) -> list[Refusal]:
    """Return a ``parallel.invalid_layout`` refusal for each broken layout invariant."""
    return [
        Refusal(
            code=RefusalCode.INVALID_LAYOUT,
            component=spec.name,
            message=problem,
            hint="set [parallel] sp_degree = ulysses_degree x ring_degree x "
            "kv_gather_degree, and use kv_gather_degree > 1 only with "
            "ulysses_degree = ring_degree = 1",
        )
        for problem in spec.parallel.check()
    ]


def head_refusals(
    name: str, spec: PipelineSpec, loader: ComponentLoader, declared: tuple[AttentionSite, ...]
) -> list[Refusal]:
    """Refuse sites whose heads the splits the kind implements cannot divide (a kind that
    splits nothing is replicated on every rank)."""
    return [
        Refusal(
            code=RefusalCode.INVALID_LAYOUT,
            component=name,
            message=f"site '{site.name}': {problem}",
            hint="pick tp_size and ulysses_degree whose product divides the head count",
        )
        for site in declared
        if (
            problem := spec.parallel.check_heads(
                site.heads, tensor=loader.tensor_parallel, sequence=loader.sequence_parallel
            )
        )
        is not None
    ]
