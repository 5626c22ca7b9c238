"""``ConfigError``, and how msgspec's validation errors become one at the key's full path.

msgspec writes a dict key as ``[...]`` in its paths and says "Invalid enum value";
the error here names the key itself and says what was expected against what was found.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import msgspec

from lifecycle.spec.sizes import ByteSize
from lifecycle.spec.structs import PipelineSpec

__all__ = ["ConfigError", "convert", "decoding_at"]

_T = TypeVar("_T")


class ConfigError(ValueError):
    """The spec cannot be decoded: one key is wrong, and this says which and how.

    Attributes:
        path: the key path, like ``$.components.vae.residency``.
        message: what was expected and what was found.
        source: the file the spec came from, if any.
    """

    def __init__(self, message: str, path: str = "$", source: str | None = None) -> None:
        self.message = message
        self.path = path
        self.source = source
        # "at `$`" names no key: a file or syntax error stands alone
        super().__init__(message if path == "$" else f"{message} - at `{path}`")


def convert(raw: object, type_: type[_T], at: str) -> _T:
    with decoding_at(at):
        return msgspec.convert(raw, type_, dec_hook=_dec_hook)


@contextmanager
def decoding_at(at: str) -> Iterator[None]:
    """Turn a msgspec validation error inside into a ConfigError at its full key path."""
    try:
        yield
    except msgspec.ValidationError as err:
        message, _, path = str(err).partition(" - at `")
        path = at + path.rstrip("`").removeprefix("$") if path else at
        raise ConfigError(_explain(message, path), path) from None


def _dec_hook(type_: type, value: object) -> object:
    if type_ is ByteSize:
        return ByteSize.parse(value)
    raise NotImplementedError(f"no decoder for {type_!r}")


_INVALID_ENUM = re.compile(r"^Invalid enum value (.+)$")


def _explain(message: str, path: str) -> str:
    """Rewrite msgspec's "Invalid enum value" as expected-vs-found."""
    match = _INVALID_ENUM.match(message)
    if match is None:
        return message
    choices = _choices_at(path)
    found = match.group(1)
    return f"Expected `{' | '.join(choices)}`, got {found}" if choices else message


def _choices_at(path: str) -> tuple[str, ...]:
    info: msgspec.inspect.Type = msgspec.inspect.type_info(PipelineSpec)
    for segment in re.findall(r"\.([^.\[]+)|\[[^\]]*\]", path.removeprefix("$")):
        info = _step(info, segment)
    return tuple(str(v) for v in _enum_values(info))


def _step(info: msgspec.inspect.Type, segment: str) -> msgspec.inspect.Type:
    for candidate in _members(info):
        if isinstance(candidate, msgspec.inspect.StructType):
            fields = {f.encode_name: f.type for f in candidate.fields}
            if segment in fields:
                return fields[segment]
        if isinstance(candidate, msgspec.inspect.DictType):
            return candidate.value_type
        if isinstance(candidate, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
            return candidate.item_type
    return msgspec.inspect.AnyType()


def _members(info: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, ...]:
    if isinstance(info, msgspec.inspect.UnionType):
        return info.types
    return (info,)


def _enum_values(info: msgspec.inspect.Type) -> list[object]:
    values: list[object] = []
    for member in _members(info):
        if isinstance(member, msgspec.inspect.EnumType):
            values.extend(e.value for e in member.cls)
        if isinstance(member, msgspec.inspect.LiteralType):
            values.extend(member.values)
    return values
