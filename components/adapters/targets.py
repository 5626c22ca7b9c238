"""Whether an adapter's targets fit a component: each a linear layer of the right shape.

Checked on any build of the component, the meta-device one admission makes included:
only module names, types and weight shapes are read.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from components.adapters.files import KeyProblem, LoraTarget

__all__ = ["target_problems"]


def target_problems(targets: Mapping[str, LoraTarget], module: nn.Module) -> list[KeyProblem]:
    """Say how ``targets`` fail ``module``, in key order: a missing or non-linear layer, a shape.

    A linear layer of ``in -> out`` features takes ``lora_A`` of ``rank x in`` and
    ``lora_B`` of ``out x rank``.
    """
    layers = dict(module.named_modules())
    problems = []
    for name, target in targets.items():
        layer = layers.get(name)
        if not isinstance(layer, nn.Linear):
            what = "no such module" if layer is None else f"a {type(layer).__name__}"
            problems.append(
                KeyProblem(
                    target.down_key,
                    f"key '{target.down_key}' targets '{name}', which is {what} in "
                    f"{type(module).__name__}, not a linear layer",
                )
            )
            continue
        want_down = [target.rank, layer.in_features]
        want_up = [layer.out_features, target.rank]
        if target.in_features != layer.in_features:
            key, has, want = target.down_key, [target.rank, target.in_features], want_down
        elif target.out_features != layer.out_features:
            key, has, want = target.up_key, [target.out_features, target.rank], want_up
        else:
            continue
        problems.append(
            KeyProblem(
                key,
                f"key '{key}' has shape {has}, but layer '{name}' (Linear "
                f"{layer.in_features} -> {layer.out_features}) takes {want}",
            )
        )
    return sorted(problems)
