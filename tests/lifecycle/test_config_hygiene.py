"""Input hygiene: merge keys, duplicate keys in linear time, caps on size, depth and numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import (
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    MAX_SPEC_VALUES,
    decode_spec,
    load_spec,
)
from lifecycle.spec.sizes import MAX_BYTES, ByteSize

YAML_BASE = "name: p\ncomponents:\n"


def error_of(text: str, fmt: str) -> ConfigError:
    """Decode ``text`` and return the ConfigError it raises."""
    with pytest.raises(ConfigError) as err:
        decode_spec(text, fmt)
    return err.value


class TestYaml:
    def test_merge_keys_are_accepted(self) -> None:
        """A component can merge another's table; a key written beside the merge wins."""
        spec = decode_spec(
            YAML_BASE
            + "  a: &base {kind: tiny_vae, residency: component_offload}\n"
            + "  b:\n    <<: *base\n    residency: resident\n"
            + "stages: [{name: s, uses: [a, b]}]\n",
            "yaml",
        )
        assert spec.components["b"].kind == "tiny_vae"
        assert spec.components["b"].residency_mode.value == "resident"
        assert spec.components["a"].residency_mode.value == "component_offload"

    def test_duplicate_key_is_refused(self) -> None:
        """A key written twice by hand in one mapping is a ConfigError naming it."""
        err = error_of(YAML_BASE + "  c: {kind: tiny_vae, kind: tiny_dit}\n", "yaml")
        assert err.message == "invalid YAML: the key 'kind' appears twice in one mapping"

    def test_duplicate_among_twenty_thousand_keys(self) -> None:
        """The duplicate check is a set, so 20,000 keys are checked at once (last one twice)."""
        keys = "".join(f"    k{i}: {i}\n" for i in range(20_000))
        err = error_of(YAML_BASE + "  c:\n" + keys + "    k19999: 0\n", "yaml")
        assert err.message == "invalid YAML: the key 'k19999' appears twice in one mapping"

    def test_alias_bomb_is_refused(self) -> None:
        """Aliases that expand a small file into a huge tree are refused by the value count."""
        layers = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
        for prev, name in zip("abcde", "bcdef", strict=True):
            layers.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
        err = error_of("\n".join(layers) + "\n", "yaml")
        assert f"more than {MAX_SPEC_VALUES} values" in err.message

    def test_unhashable_key_is_a_config_error(self) -> None:
        """A sequence used as a key is bad YAML, reported as such."""
        assert error_of("? [1, 2]\n: 3\n", "yaml").message.startswith("invalid YAML:")


class TestCaps:
    @pytest.mark.parametrize(
        ("fmt", "text"),
        [
            ("json", "[" * 50_000 + "]" * 50_000),
            ("toml", "a = " + "[" * 50_000 + "]" * 50_000),
            ("yaml", "a: " + "[" * 50_000 + "]" * 50_000),
            ("json", '{"a":' * (MAX_SPEC_DEPTH + 1) + "1" + "}" * (MAX_SPEC_DEPTH + 1)),
        ],
        ids=["json", "toml", "yaml", "json-just-over"],
    )
    def test_deep_nesting_is_a_config_error(self, fmt: str, text: str) -> None:
        """Nesting deeper than any spec needs is a ConfigError, never a RecursionError."""
        message = error_of(text, fmt).message
        assert "nested deeper than" in message or "maximum nesting depth" in message

    def test_oversized_file_is_refused_unread(self, tmp_path: Path) -> None:
        """A spec file over the size cap is refused before it is parsed."""
        path = tmp_path / "big.toml"
        path.write_bytes(b"#" * (MAX_SPEC_BYTES + 1))
        with pytest.raises(ConfigError) as err:
            load_spec(path)
        assert "larger than 1024 KiB" in err.value.message

    @pytest.mark.parametrize(
        "value",
        ['"' + "9" * 400 + 'GiB"', "9" * 400, '"1' + "0" * 400 + '.5 B"'],
        ids=["string", "integer", "decimal"],
    )
    def test_huge_sizes_are_config_errors(self, value: str) -> None:
        """A 400-digit device_budget is a ConfigError at its key, never an OverflowError."""
        text = f'name = "p"\n[components.c]\nkind = "tiny_vae"\n[memory]\ndevice_budget = {value}\n'
        err = error_of(text, "toml")
        assert err.path == "$.memory.device_budget"
        assert "at most 8 EiB" in err.message

    @pytest.mark.parametrize("fmt", ["json", "toml"])
    def test_integers_beyond_python_limits_are_config_errors(self, fmt: str) -> None:
        """An integer of 5,000 digits is bad input, not a traceback."""
        digits = "9" * 5000
        text = f'{{"a": {digits}}}' if fmt == "json" else f"a = {digits}"
        assert error_of(text, fmt).message.startswith(f"invalid {fmt.upper()}:")

    def test_sizes_stay_exact(self) -> None:
        """Sizes parse exactly, up to the cap."""
        assert ByteSize.parse("1.5 KiB") == 1536
        assert ByteSize.parse("8 TiB") == 8 * 2**40
        assert ByteSize.parse(MAX_BYTES) == MAX_BYTES
