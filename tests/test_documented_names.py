"""Every public name the README and docs/design.md spell out still imports from where they say.

A dotted name in backticks under one of the three packages is a Python name unless the code
spells it as something else: a refusal code, a log event's name, or a config key (its
placeholder segments are capitals: ``components.NAME.cache``).
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from lifecycle.refusals import RefusalCode

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lifecycle", "components", "attention")
DOCUMENTS = ("README.md", "docs/design.md")
DOTTED = re.compile(r"`((?:lifecycle|components|attention)(?:\.[A-Za-z_]\w*)+)")
"""A backticked dotted name under one of the packages (what follows it, a call or a
subscript, is left off)."""
LOG_CALLS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})
MAY_LOG = re.compile(rf"\.(?:{'|'.join(LOG_CALLS)})\(|\btag\s*=")
"""Text that a source holding a log call or an event struct's tag has."""


def documented_names() -> list[str]:
    """Return every dotted name the documents spell in backticks, each once, sorted."""
    found = {name for doc in DOCUMENTS for name in DOTTED.findall((ROOT / doc).read_text())}
    return sorted(found)


def event_names() -> frozenset[str]:
    """Return every log event's name the packages write, and every event struct's tag.

    Only the sources that spell a log call or a ``tag=`` keyword are parsed (formatted code
    writes a call's parenthesis right after the name): a few dozen of the packages' modules,
    where every xdist worker reads them to collect this file.
    """
    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            source = path.read_text()
            if not MAY_LOG.search(source):
                continue
            for node in ast.walk(ast.parse(source)):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LOG_CALLS
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    names.add(node.args[0].value)
                elif (
                    isinstance(node, ast.keyword)
                    and node.arg == "tag"
                    and isinstance(node.value, ast.Constant)
                ):
                    names.add(node.value.value)
    return frozenset(names)


def is_python_name(name: str, events: frozenset[str]) -> bool:
    """Tell whether a documented dotted name means a module or an object in one."""
    codes = {code.value for code in RefusalCode}
    placeholder = any(part.isupper() for part in name.split(".")[1:])
    return name not in codes and name not in events and not placeholder


def home(name: str) -> tuple[ModuleType, list[str]]:
    """Import the longest module that ``name`` starts with; return it and the parts after it.

    Raises:
        ImportError: not even the package imports.
    """
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:end])), parts[end:]
        except ModuleNotFoundError:
            continue
    raise ImportError(f"no module of {name!r} imports")


def resolve(name: str) -> object:
    """Import the longest module that ``name`` starts with, then look the rest up on it.

    Raises:
        ImportError: not even the package imports.
        AttributeError: the module lacks what follows.
    """
    found: object
    found, rest = home(name)
    for part in rest:
        found = getattr(found, part)
    return found


def unexported(names: list[str]) -> list[str]:
    """Return each of ``names`` that its module leaves out of ``__all__``: a module itself,
    or an old name that warns on use, needs no place there."""
    wrong = []
    for name in names:
        module, rest = home(name)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            first = getattr(module, rest[0]) if rest else module
        exports = getattr(module, "__all__", ())
        if not isinstance(first, ModuleType) and not warned and rest[0] not in exports:
            wrong.append(name)
    return wrong


EVENTS = event_names()
NAMES = [name for name in documented_names() if is_python_name(name, EVENTS)]


class TestDocumentedNames:
    def test_codes_events_and_keys_are_not_taken_for_names(self) -> None:
        """The scan keeps the names a reader imports and leaves codes, events and config keys."""
        kept = {"lifecycle.Orchestrator", "components.batch.Batch", "attention.Attention"}
        left = {"attention.capability_missing", "lifecycle.transition", "components.NAME.cache"}
        assert kept | left <= set(documented_names())
        assert kept <= set(NAMES)
        assert not left & set(NAMES)

    @pytest.mark.parametrize("name", NAMES)
    def test_a_documented_name_imports(self, name: str) -> None:
        """The name imports from the module the documents give it."""
        with warnings.catch_warnings():  # an old name documented as such warns, and imports
            warnings.simplefilter("ignore", DeprecationWarning)
            assert resolve(name) is not None

    def test_a_documented_name_is_exported(self) -> None:
        """Each documented name is in its module's ``__all__`` (an old name that warns is not),
        and one left out is named."""
        assert unexported(["lifecycle.events.Refused", "lifecycle.events.log"]) == [
            "lifecycle.events.log"
        ]
        assert unexported(NAMES) == []
