"""The pipeline spec: decoding, explicit vs default, and errors that name the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
import yaml

from components import ParallelLayout, ResidencyMode
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec, load_spec, spec_schema
from lifecycle.spec.sizes import SIZE_PATTERN, ByteSize
from lifecycle.spec.structs import PipelineSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

MINIMAL = """
name = "p"
[components.vae]
kind = "tiny_vae"
"""


def decode_with(extra: str) -> PipelineSpec:
    """Decode the minimal spec with ``extra`` TOML appended."""
    return decode_spec(MINIMAL + extra)


def error_of(text: str, fmt: str = "toml") -> ConfigError:
    """Return the ConfigError that decoding ``text`` raises."""
    with pytest.raises(ConfigError) as err:
        decode_spec(text, fmt)
    return err.value


class TestDecode:
    def test_reference_example_decodes(self) -> None:
        """The reference spec decodes with its three components and stages in order."""
        spec = load_spec(EXAMPLES / "tiny_t2i.toml")
        assert spec.name == "tiny-t2i"
        assert list(spec.components) == ["text_encoder", "transformer", "vae"]
        assert [s.name for s in spec.stages] == ["encode", "denoise", "decode"]
        assert spec.components["transformer"].options == {"packed_sequences": True}

    def test_same_spec_from_toml_json_yaml_is_equal(self, tmp_path: Path) -> None:
        """One spec written as TOML, JSON and YAML decodes to equal Structs."""
        toml_spec = load_spec(EXAMPLES / "tiny_t2i.toml")
        raw = msgspec.to_builtins(toml_spec)
        (tmp_path / "p.json").write_text(json.dumps(raw))
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
        assert load_spec(tmp_path / "p.json") == toml_spec
        assert load_spec(tmp_path / "p.yaml") == toml_spec

    def test_sizes_with_units(self) -> None:
        """Sizes decode from strings with binary or decimal units and from plain ints."""
        for written, expected in [('"2GiB"', 2 * 2**30), ('"512 MB"', 512 * 10**6), ("1024", 1024)]:
            spec = decode_with(f"[memory]\ndevice_budget = {written}\n")
            assert spec.memory.device_budget == expected
            assert isinstance(spec.memory.device_budget, ByteSize)

    @pytest.mark.parametrize("text", ["2GiB", "512 MB", "10", "3b", "1.5gib", "2K", "2Ki", "x"])
    def test_schema_size_pattern_agrees_with_the_parser(self, text: str) -> None:
        """The JSON Schema's size pattern accepts exactly what the decoder accepts."""
        try:
            ByteSize.parse(text)
            parsed = True
        except ValueError:
            parsed = False
        assert bool(re.match(SIZE_PATTERN, text)) is parsed

    def test_layout_defaults_to_one_process(self) -> None:
        """Without [parallel] every degree is 1 and the world is one process."""
        spec = decode_with("")
        assert spec.parallel == ParallelLayout()
        assert spec.parallel.world_size == 1

    def test_schema_describes_the_spec(self) -> None:
        """The JSON Schema names every top-level key and the residency choices."""
        schema = spec_schema()
        root = schema["$defs"]["PipelineSpec"]["properties"]
        assert set(root) == {
            "name",
            "components",
            "source",
            "source_download",
            "variant",
            "device",
            "dtype",
            "attention",
            "parallel",
            "memory",
            "serving",
            "adapters",
            "stages",
            "acceleration",
            "acceleration_min_psnr",
        }
        residency = schema["$defs"]["ResidencyMode"]["enum"]
        assert set(residency) == {"resident", "component_offload", "layerwise_offload"}


class TestExplicitness:
    def test_absent_keys_are_default(self) -> None:
        """Keys not written stay UNSET, and the effective value is the default."""
        component = decode_with("").components["vae"]
        assert component.residency is msgspec.UNSET
        assert component.residency_mode is ResidencyMode.RESIDENT
        assert component.loader is msgspec.UNSET
        assert component.role_backends() == {}

    def test_written_keys_are_explicit(self) -> None:
        """A key that is present is explicit, even when it equals the default."""
        spec = decode_spec(
            """
name = "p"
[attention]
backend = "torch_sdpa"
[components.vae]
kind = "tiny_vae"
residency = "resident"
loader = "custom"
attention_backend = { all = "torch_sdpa", cross = "torch_flash" }
"""
        )
        component = spec.components["vae"]
        assert component.residency is ResidencyMode.RESIDENT
        assert component.loader == "custom"
        assert component.role_backends() == {"all": "torch_sdpa", "cross": "torch_flash"}
        assert spec.attention.backend == "torch_sdpa"

    def test_component_wide_name_means_all_roles(self) -> None:
        """A plain backend name is the component-wide (``all``) choice."""
        component = decode_with('attention_backend = "torch_flash"\n').components["vae"]
        assert component.role_backends() == {"all": "torch_flash"}


class TestConfigErrors:
    def test_unknown_top_level_key(self) -> None:
        """An unknown key at the root is named, at ``$``."""
        err = error_of(MINIMAL.replace('name = "p"', 'name = "p"\nnmae = "q"'))
        assert err.path == "$"
        assert err.message == "Object contains unknown field `nmae`"

    def test_unknown_component_key_names_the_component(self) -> None:
        """An unknown key inside a component is reported at that component's path."""
        err = error_of(MINIMAL + 'residncy = "resident"\n')
        assert err.path == "$.components.vae"
        assert err.message == "Object contains unknown field `residncy`"

    def test_bad_enum_value_lists_the_choices(self) -> None:
        """A misspelt residency lists every mode and quotes what was found."""
        err = error_of(MINIMAL + 'residency = "offlaod"\n')
        assert err.path == "$.components.vae.residency"
        assert err.message == (
            "Expected `resident | component_offload | layerwise_offload`, got 'offlaod'"
        )
        assert str(err) == f"{err.message} - at `$.components.vae.residency`"

    def test_bad_literal_lists_the_choices(self) -> None:
        """A bad offload target lists disk and host."""
        err = error_of(MINIMAL + '[memory]\noffload_target = "ssd"\n')
        assert err.path == "$.memory.offload_target"
        assert err.message == "Expected `disk | host`, got 'ssd'"

    def test_wrong_type(self) -> None:
        """A degree written as a string is a type error at its key."""
        err = error_of(MINIMAL + '[parallel]\ntp_size = "2"\n')
        assert err.path == "$.parallel.tp_size"
        assert err.message == "Expected `int`, got `str`"

    def test_degree_below_one(self) -> None:
        """A parallel degree of 0 is a decode-time range error."""
        err = error_of(MINIMAL + "[parallel]\nring_degree = 0\n")
        assert err.path == "$.parallel.ring_degree"
        assert err.message == "Expected `int` >= 1"

    @pytest.mark.parametrize("folder", ['""', '"  "'])
    def test_blank_offload_dir(self, folder: str) -> None:
        """An empty or blank offload_dir, the working directory, is an error at its key."""
        err = error_of(MINIMAL + f"[memory]\noffload_dir = {folder}\n")
        assert err.path == "$.memory.offload_dir"
        assert err.message.startswith(f"Expected a folder, got {folder[1:-1]!r}, which would")

    @pytest.mark.parametrize("size", ['"2 GiBs"', '"lots"', "-1", "true"])
    def test_bad_size(self, size: str) -> None:
        """A size that is not a count with a known unit names the key and the form."""
        err = error_of(MINIMAL + f"[memory]\ndevice_budget = {size}\n")
        assert err.path == "$.memory.device_budget"
        assert err.message.startswith('Expected a size like "2GiB", "512MB" or a byte count')

    def test_stage_naming_an_unknown_component(self) -> None:
        """A stage that uses an undeclared component is refused at that use."""
        err = error_of(MINIMAL + '[[stages]]\nname = "decode"\nuses = ["vae", "vea"]\n')
        assert err.path == "$.stages[0].uses[1]"
        assert err.message == "Expected a declared component (vae), got 'vea'"

    def test_duplicate_stage_name(self) -> None:
        """Two stages with one name are refused at the second."""
        stage = '[[stages]]\nname = "decode"\nuses = ["vae"]\n'
        err = error_of(MINIMAL + stage + stage)
        assert err.path == "$.stages[1].name"
        assert (
            err.message == "Expected a unique stage name, got 'decode' again (first at $.stages[0])"
        )

    def test_duplicate_use_in_a_stage(self) -> None:
        """A stage that lists one component twice is refused at the repeat."""
        err = error_of(MINIMAL + '[[stages]]\nname = "d"\nuses = ["vae", "vae"]\n')
        assert err.path == "$.stages[0].uses[1]"

    def test_duplicate_key_in_json(self) -> None:
        """JSON that writes one key twice is refused instead of keeping the last."""
        text = '{"name": "p", "name": "q", "components": {"vae": {"kind": "tiny_vae"}}}'
        err = error_of(text, "json")
        assert err.message == "invalid JSON: the key 'name' appears twice in one object"

    def test_duplicate_key_in_yaml(self) -> None:
        """YAML that writes one key twice is refused instead of keeping the last."""
        text = "name: p\ncomponents:\n  vae: {kind: tiny_vae}\n  vae: {kind: tiny_dit}\n"
        err = error_of(text, "yaml")
        assert err.message == "invalid YAML: the key 'vae' appears twice in one mapping"

    def test_unknown_backend_name_lists_known_ones(self) -> None:
        """A backend name nobody registered is a ConfigError listing the known names."""
        err = error_of(MINIMAL + 'attention_backend = "flashy"\n')
        assert err.path == "$.components.vae.attention_backend"
        assert err.message.startswith("Expected a known attention backend (torch_sdpa, ")
        assert err.message.endswith("got 'flashy'")

    def test_unknown_role_key(self) -> None:
        """A per-role table key that is no role is named with the known keys."""
        err = error_of(MINIMAL + 'attention_backend = { crss = "torch_sdpa" }\n')
        assert err.path == "$.components.vae.attention_backend.crss"
        assert err.message == "Expected `all | self | cross`, got 'crss'"

    def test_unknown_backend_in_role_table(self) -> None:
        """A bad backend name inside a role table is reported at its role key."""
        err = error_of(MINIMAL + 'attention_backend = { self = "nope" }\n')
        assert err.path == "$.components.vae.attention_backend.self"

    def test_unknown_global_backend(self) -> None:
        """A bad global backend is reported at $.attention.backend."""
        err = error_of(MINIMAL.replace('name = "p"', 'name = "p"\nattention.backend = "nope"'))
        assert err.path == "$.attention.backend"

    def test_backend_options_are_validated_by_the_backend(self) -> None:
        """Options of a backend are checked by that backend's options type."""
        err = error_of(MINIMAL + "[attention.backend_options.sliding_window]\nwindw = 4\n")
        assert err.path == "$.attention.backend_options.sliding_window"
        assert err.message == "Object contains unknown field `windw`"

    def test_seed_and_weights_exclude_each_other(self) -> None:
        """A seeded kind given both a seed and a weights file is refused at its options."""
        err = error_of(MINIMAL + 'options = { seed = 3, weights = "w.safetensors" }\n')
        assert err.path == "$.components.vae.options"
        assert err.message.startswith("seed and weights exclude each other")

    def test_fsdp_names_a_declared_component(self) -> None:
        """FSDP over an undeclared component is refused at $.parallel.fsdp."""
        err = error_of(MINIMAL + '[parallel]\nfsdp = ["transformer"]\n')
        assert err.path == "$.parallel.fsdp[0]"

    def test_component_name_is_a_plain_identifier(self) -> None:
        """A component name with spaces is refused, since it names files and log fields."""
        err = error_of('name = "p"\n[components."my vae"]\nkind = "tiny_vae"\n')
        assert err.path == "$.components.my vae"

    def test_no_components(self) -> None:
        """A pipeline with no components is refused at $.components."""
        err = error_of('name = "p"\ncomponents = {}\n')
        assert err.path == "$.components"

    def test_syntax_error(self) -> None:
        """Broken TOML is one line that says where."""
        err = error_of('name = "p\n')
        assert err.message.startswith("invalid TOML: ")
        assert err.path == "$"

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing file is a ConfigError that names the file."""
        with pytest.raises(ConfigError) as err:
            load_spec(tmp_path / "absent.toml")
        assert err.value.source == str(tmp_path / "absent.toml")
        assert "No such file or directory" in err.value.message

    def test_unknown_extension(self, tmp_path: Path) -> None:
        """A spec whose extension names no known format is refused."""
        path = tmp_path / "p.ini"
        path.write_text(MINIMAL)
        with pytest.raises(
            ConfigError, match="Expected a \\.toml, \\.json, \\.yaml or \\.yml spec"
        ):
            load_spec(path)
