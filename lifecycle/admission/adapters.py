"""Admit the adapters (LoRA) of a pipeline from their files' headers (design §14).

Each adapter's file must name layers of its component that are linear, with shapes
that fit and ranks that agree (checked on the component built on the meta device);
a merged adapter needs a component that stays on the device whole, and no adapter
applies to a component the layout shards.

Why a merged adapter refuses an offloaded component (``adapter.offloaded_component``)
rather than having the store rewrite and re-verify its files: the offload copy is what
comes back at every onload, so a merge would have to rewrite (and hash) the whole
component at every switch, and a crash between the merge and the rewrite would leave
verified files that no longer hold the base. Refused, the files always hold the base;
an unmerged adapter never touches the weights, so it serves such components instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from msgspec import UnsetType
from torch import nn

from components import ResidencyMode
from components.adapters import AdapterFile, KeyProblem, LoraTarget, target_problems
from components.random_fills import built_on_meta
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import AdapterSpec, PipelineSpec

__all__ = ["AdapterAdmission", "admit_adapter", "admit_adapters"]


@dataclass(frozen=True)
class AdapterAdmission:
    """What admission found for one adapter.

    Attributes:
        component: the component it changes, or None when none could be told.
        file: its file's header, or None when it could not be read.
        targets: the layers it changes by module path (empty when refused).
        refusals: every reason it is refused.
    """

    component: str | None
    file: AdapterFile | None = None
    targets: dict[str, LoraTarget] = field(default_factory=dict)
    refusals: tuple[Refusal, ...] = ()


def admit_adapters(
    spec: PipelineSpec,
    paths: Mapping[str, str | None],
    builders: Mapping[str, Callable[[], nn.Module]],
) -> dict[str, AdapterAdmission]:
    """Admit every adapter of ``spec`` against its component.

    ``paths`` are the components' admitted loading paths (None: refused) and
    ``builders`` build each admitted component (in its attention scope).
    """
    return {
        name: admit_adapter(name, adapter, spec, paths, builders)
        for name, adapter in spec.adapters.items()
    }


def admit_adapter(
    name: str,
    adapter: AdapterSpec,
    spec: PipelineSpec,
    paths: Mapping[str, str | None],
    builders: Mapping[str, Callable[[], nn.Module]],
) -> AdapterAdmission:
    """Admit adapter ``name`` of ``spec`` (which need not list it) against its component."""

    def refuse(code: RefusalCode, message: str, hint: str) -> Refusal:
        return Refusal(code=code, component=name, message=f"adapter '{name}': {message}", hint=hint)

    try:
        file = AdapterFile.read(Path(adapter.path))
    except (OSError, ValueError) as err:
        return AdapterAdmission(
            None,
            refusals=(
                refuse(
                    RefusalCode.ADAPTER_TARGET_MISMATCH,
                    f"its file {adapter.path} cannot be read ({err})",
                    f"point adapters.{name}.path at a LoRA safetensors file",
                ),
            ),
        )
    component = adapter.component if isinstance(adapter.component, str) else file.prefix
    if component is None or component not in spec.components:
        return AdapterAdmission(
            None,
            file,
            refusals=(
                refuse(
                    RefusalCode.ADAPTER_TARGET_MISMATCH,
                    f"its keys name no component of the pipeline (their common prefix: "
                    f"{file.prefix!r}; components: {', '.join(spec.components)})",
                    f"set adapters.{name}.component to the component it adapts",
                ),
            ),
        )
    refusals: list[Refusal] = []
    placement = _placement_refusal(name, adapter, component, spec)
    if placement is not None:
        refusals.append(placement)
    for problem in file.problems:
        refusals.append(
            refuse(
                RefusalCode.ADAPTER_TARGET_MISMATCH,
                f"its file {adapter.path}: {problem}",
                "save the LoRA with one rank and alpha for every layer, without DoRA",
            )
        )
    targets, problems = file.targets(component if file.prefix == component else None)
    path = paths.get(component)
    native = path == "native"
    if path is not None and not problems:
        try:
            module = built_on_meta(builders[component])
        except Exception as err:  # a kind's own code: whatever it raises is the reason
            failed = refuse(
                RefusalCode.ADAPTER_TARGET_MISMATCH,
                f"building component '{component}' on the meta device to find the layers "
                f"the adapter targets failed ({type(err).__name__}: {err})",
                f"fix component '{component}' (lifecycle check names its problems)",
            )
            return AdapterAdmission(component, file, {}, (*refusals, failed))
        problems = target_problems(targets, module)
    if problems:
        refusals.append(_mismatch(name, component, problems, native=native))
    return AdapterAdmission(component, file, {} if refusals else targets, tuple(refusals))


def _mismatch(name: str, component: str, problems: list[KeyProblem], *, native: bool) -> Refusal:
    others = f" ({len(problems) - 1} more key(s) fail too)" if len(problems) > 1 else ""
    if native:
        return Refusal(
            code=RefusalCode.ADAPTER_NATIVE_UNSUPPORTED,
            component=name,
            message=f"adapter '{name}': component '{component}' runs its native path, which "
            f"does not build the layer a key targets: {problems[0].message}{others}",
            hint=f'set components.{component}.loader = "custom" (our build of it has the '
            "linear layers the LoRA targets), or drop the adapter",
        )
    return Refusal(
        code=RefusalCode.ADAPTER_TARGET_MISMATCH,
        component=name,
        message=f"adapter '{name}' does not fit component '{component}': "
        f"{problems[0].message}{others}",
        hint=f"use a LoRA trained for this component's architecture, or set "
        f"adapters.{name}.component to the component it was trained for",
    )


def _placement_refusal(
    name: str, adapter: AdapterSpec, component: str, spec: PipelineSpec
) -> Refusal | None:
    """Refuse an adapter its component's layout or residency cannot honour."""
    sharded = [s for s in spec.parallel.splits(component) if s.startswith("tp_size") or s == "fsdp"]
    if sharded:
        return Refusal(
            code=RefusalCode.ADAPTER_SHARDED_COMPONENT,
            component=name,
            message=f"adapter '{name}' changes component '{component}', which the layout "
            f"shards ({', '.join(sharded)}): its file holds whole matrices, not this rank's "
            "shards",
            hint=f"run '{component}' whole (tp_size = 1, not in parallel.fsdp) to use the "
            "adapter, or drop it",
        )
    declared = spec.components[component]
    residency = declared.residency_mode
    if adapter.mode != "merged":
        return None
    if declared.quantization_mode != "off":
        return Refusal(
            code=RefusalCode.ADAPTER_QUANTIZED_COMPONENT,
            component=name,
            message=f"merged adapter '{name}' changes component '{component}', whose linear "
            f"weights are quantized ({declared.quantization_mode}): a merge would round the "
            "adapted weights to the quantized grid, and an unmerge could not put the base back",
            hint=f'set adapters.{name}.mode = "unmerged" (its delta is added on top of the '
            f"quantized base), or remove components.{component}.quantization",
        )
    if residency is not ResidencyMode.RESIDENT:
        why = f"whose residency is {residency.value}"
    elif not declared.is_pinned and not isinstance(spec.memory.device_budget, UnsetType):
        why = "which the budget may evict (it is resident by default, not explicitly)"
    else:
        return None
    return Refusal(
        code=RefusalCode.ADAPTER_OFFLOADED_COMPONENT,
        component=name,
        message=f"merged adapter '{name}' changes component '{component}', {why}: its "
        "weights would come back from the offload copy, which holds the base",
        hint=f'set adapters.{name}.mode = "unmerged" (the weights never change), or '
        f'components.{component}.residency = "resident"',
    )
