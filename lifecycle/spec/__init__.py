"""The pipeline spec (design §8): frozen msgspec Structs decoded from TOML, JSON or YAML.

A key's presence is what makes a choice *explicit*: optional choices default to
``UNSET``, and the effective-value helpers tell the two apart. Everything wrong with one
file is a ``ConfigError`` that names the key path, what was expected and what was found;
anything that involves several keys or the platform is left to admission, which refuses.

``structs`` holds the Structs; ``reading`` reads a file within bounds and decodes it;
``errors`` says where a key is wrong; ``checks`` checks what the types cannot say;
``sources`` resolves a diffusers-format folder, ``model_ids`` says what a model id
names; ``sizes`` parses byte sizes.
"""

from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import (
    adapter_file,
    decode_spec,
    load_spec,
    load_worker_file,
    spec_schema,
)
from lifecycle.spec.sizes import ByteSize
from lifecycle.spec.structs import (
    AdapterSpec,
    AttentionConfig,
    ComponentSpec,
    LayerwiseConfig,
    MemoryConfig,
    PipelineSpec,
    ServingConfig,
    StageSpec,
    WorkerFile,
    WorkerSettings,
)

__all__ = [
    "AdapterSpec",
    "AttentionConfig",
    "ByteSize",
    "ComponentSpec",
    "ConfigError",
    "LayerwiseConfig",
    "MemoryConfig",
    "PipelineSpec",
    "ServingConfig",
    "StageSpec",
    "WorkerFile",
    "WorkerSettings",
    "adapter_file",
    "decode_spec",
    "load_spec",
    "load_worker_file",
    "spec_schema",
]
