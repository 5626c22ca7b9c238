"""Mutated pipeline specs for the fuzz test, and the in-process CLI it drives them through."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from lifecycle.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
BASES = [
    tomllib.loads(path.read_text())
    for path in sorted((ROOT / "examples").glob("*.toml"))
    + sorted((ROOT / "examples" / "refused").glob("*.toml"))
]
FORMATS = ("toml", "json", "yaml")
KEYS = (
    *("name", "kind", "residency", "attention_backend", "loader", "layerwise", "options"),
    *("stages", "uses", "device", "tp_size", "dp_size", "sp_degree", "ulysses_degree"),
    *("ring_degree", "kv_gather_degree", "cfg_parallel", "fsdp", "device_budget"),
    *("offload_target", "context_dim", "in_channels", "latent_channels", "dim", "heads"),
    *("layers", "ffn_dim", "channels", "groups", "seed", "weights", "prefetch"),
    *("resident_layers", "packed_sequences", "factory", "backend", "backend_options"),
    *("window", "all", "self", "cross", "max_tokens", "tokenizer"),
)
WORDS = (
    *("tiny_dit", "tiny_vae", "tiny_text_encoder", "tiny_upsampler", "minilm_text_encoder"),
    *("torch_sdpa", "torch_flash", "reference", "sliding_window", "flash_attn", "resident"),
    *("component_offload", "layerwise_offload", "host", "disk", "custom", "native", "cpu"),
    *("cuda", "auto", "2GiB", "64KiB", "1e400", "os:fork", "../../x", "/", "transformer"),
    *("vae", "text_encoder", "encode", "denoise", "decode"),
)
WEIGHTS = str(ROOT / "examples" / "refused" / "weights" / "upsampler_4ch.safetensors")

plausible = st.one_of(st.integers(1, 64), st.sampled_from(WORDS), st.booleans())
scalars = st.one_of(
    st.none(),
    st.integers(-2, 70),
    st.integers(min_value=-(10**30), max_value=10**420),
    st.floats(),
    st.text(max_size=8),
    st.just(WEIGHTS),
)
# Plausible values (small widths, known names) three times as often as anything else,
# so that many mutants are admitted and reach the loader and the run.
values = st.one_of(
    plausible,
    plausible,
    plausible,
    st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=6,
    ),
)


OPTIONS = {
    "tiny_text_encoder": ("dim", "heads", "layers", "ffn_dim", "max_len", "vocab_size", "seed"),
    "tiny_dit": ("in_channels", "dim", "heads", "layers", "ffn_dim", "context_dim", "seed"),
    "tiny_vae": ("latent_channels", "channels", "groups", "heads", "seed"),
    "tiny_upsampler": ("channels", "seed"),
    "minilm_text_encoder": ("max_tokens",),
}
SETTINGS = {
    "residency": st.sampled_from(["resident", "component_offload", "layerwise_offload"]),
    "attention_backend": st.sampled_from(["torch_sdpa", "torch_flash", "reference"])
    | st.fixed_dictionaries({"self": st.sampled_from(["torch_sdpa", "sliding_window"])}),
    "loader": st.sampled_from(["custom", "native"]),
    "layerwise": st.fixed_dictionaries(
        {"prefetch": st.integers(0, 3), "resident_layers": st.integers(0, 4)}
    ),
}
LAYOUT = ("tp_size", "dp_size", "ring_degree", "ulysses_degree", "sp_degree", "cfg_parallel")


@st.composite
def targeted_edit(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """Change one thing a user would: an option's width, a residency, a layout, a budget.

    An edit whose table an earlier random edit replaced by a non-table does nothing.
    """
    target = draw(st.sampled_from(("option", "setting", "layout", "budget", "target")))
    if target in ("option", "setting"):
        components = spec.get("components")
        if not isinstance(components, dict) or not components:
            return
        component = components[draw(st.sampled_from(sorted(components, key=str)))]
        if not isinstance(component, dict):
            return
        if target == "setting":
            key = draw(st.sampled_from(sorted(SETTINGS)))
            component[key] = draw(SETTINGS[key])
        elif isinstance(component.get("kind"), str) and component["kind"] in OPTIONS:
            options = component.setdefault("options", {})
            if isinstance(options, dict):
                options[draw(st.sampled_from(OPTIONS[component["kind"]]))] = draw(
                    st.integers(1, 64)
                )
        return
    table = spec.setdefault("parallel" if target == "layout" else "memory", {})
    if not isinstance(table, dict):
        return
    if target == "layout":
        key = draw(st.sampled_from(LAYOUT))
        table[key] = draw(st.booleans()) if key == "cfg_parallel" else draw(st.integers(1, 4))
    elif target == "budget":
        table["device_budget"] = draw(st.sampled_from(["64KiB", "1MiB", "100MiB", "2GiB", 10**6]))
    else:
        table["offload_target"] = draw(st.sampled_from(["host", "disk"]))


@st.composite
def mutated_specs(draw: st.DrawFn) -> dict[str, Any]:
    """Return one of the example specs with one to three edits: targeted ones, or any key
    set, added or removed at random."""
    spec: dict[str, Any] = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            draw(targeted_edit(spec))
            continue
        container: Any = spec
        while True:  # walk down a random branch, stopping at some depth
            children = list(container.values()) if isinstance(container, dict) else list(container)
            nested = [c for c in children if isinstance(c, dict | list) and c]
            if not nested or draw(st.booleans()):
                break
            container = draw(st.sampled_from(nested))
        operation = draw(st.sampled_from(("set", "add", "delete")))
        if isinstance(container, dict):
            keys = list(container)
            if operation == "add" or not keys:
                container[draw(st.sampled_from(KEYS))] = draw(values)
            elif operation == "set":
                container[draw(st.sampled_from(keys))] = draw(values)
            else:
                del container[draw(st.sampled_from(keys))]
        elif container:
            index = draw(st.integers(0, len(container) - 1))
            if operation == "delete":
                del container[index]
            else:
                container[index] = draw(values)
    return spec


@st.composite
def spec_texts(draw: st.DrawFn) -> tuple[str, str]:
    """Return a mutated spec written in one of the formats, its text sometimes cut or spliced."""
    fmt = draw(st.sampled_from(FORMATS))
    text = write(draw(mutated_specs()), fmt)
    if draw(st.integers(0, 9)) == 0:
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=6)) + text[cut + draw(st.integers(0, 8)) :]
    return fmt, text


def write(spec: dict[str, Any], fmt: str) -> str:
    """Write ``spec`` as ``fmt`` text (None values are dropped from TOML, which has none)."""
    if fmt == "json":
        return json.dumps(spec)
    if fmt == "yaml":
        return yaml.safe_dump(spec)
    return "".join(f"{_toml_key(k)} = {_toml(v)}\n" for k, v in spec.items() if v is not None)


def _toml_key(key: object) -> str:
    return json.dumps(str(key))


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = (f"{_toml_key(k)} = {_toml(v)}" for k, v in value.items() if v is not None)
        return "{ " + ", ".join(items) + " }"
    raise TypeError(f"no TOML for {value!r}")


@dataclass(frozen=True)
class Outcome:
    """What one in-process ``lifecycle`` command did."""

    code: int
    stdout: str
    stderr: str


def lifecycle(*argv: str) -> Outcome:
    """Run the CLI's ``main`` in this process, capturing what it writes.

    ``main`` configures structlog for the process; ``process_state`` (tests/conftest.py)
    puts the configuration back after the test.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return Outcome(code, out.getvalue(), err.getvalue())


def world_size(text: str, fmt: str) -> int:
    """Return the processes an admitted spec's layout needs (1 unless it says otherwise)."""
    from lifecycle.spec.reading import decode_spec

    return decode_spec(text, fmt).parallel.world_size


def place_offload(text: str, fmt: str, folder: Path) -> str:
    """Return the spec with its offload folder moved under ``folder`` (runs write there)."""
    if fmt == "toml":
        raw = tomllib.loads(text)
    elif fmt == "json":
        raw = json.loads(text)
    else:
        raw = yaml.safe_load(text)
    raw.setdefault("memory", {})["offload_dir"] = str(folder)
    return write(raw, fmt)
