"""Each module of the three packages says what it exports, and the others import only that.

A module declares ``__all__``: the names other modules of the project, and users, may import
from it (the rest is its own, as in structlog and msgspec). A module whose name has a leading
underscore may skip it: then it is its package's own, and only modules of that package
import from it. Read from the sources (``ast``, nothing is imported) by a fixture of this
file's tests, not at import: every xdist worker imports this file to collect it, and the
parsed trees, kept, would slow every later garbage collection of the run. tests/ and
benchmarks/ may import anything.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import pytest

from tests.test_arrows import FLOORS, ROOT, module_name


@pytest.fixture(scope="module")
def house() -> dict[str, ast.Module]:
    """Every module of the house, parsed, by dotted name."""
    return {
        module_name(path): ast.parse(path.read_text())
        for floor in FLOORS
        for path in sorted((ROOT / floor).rglob("*.py"))
    }


ANY_MODULE = ("*", "__all__")
"""What an import may take from any module: its exports, or the list of them (a module kept
where the design first placed it re-exports another's)."""


class Taken(NamedTuple):
    """One name a module takes from another module of the house."""

    importer: str
    line: int
    target: str
    name: str

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} takes {self.name} from {self.target}"


def top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Yield every statement that runs at import, inside ``if`` and ``try`` blocks too."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            handlers = [h.body for h in node.handlers] if isinstance(node, ast.Try) else []
            finals = node.finalbody if isinstance(node, ast.Try) else []
            for block in (node.body, node.orelse, *handlers, finals):
                yield from top_level(block)


def declared(module: str, trees: Mapping[str, ast.Module]) -> list[str] | None:
    """Return the ``__all__`` of ``module`` (a literal list, or one imported from another
    module of the house), or None where it declares none."""
    for node in top_level(trees[module].body):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return list(ast.literal_eval(node.value))
        if (
            isinstance(node, ast.ImportFrom)
            and node.module in trees
            and any((a.asname or a.name) == "__all__" for a in node.names)
        ):
            return declared(node.module, trees)
    return None


def bound(module: str, trees: Mapping[str, ast.Module]) -> set[str]:
    """Return every name ``module`` binds at import (``from m import *`` binds m's exports)."""
    names = set()
    for node in top_level(trees[module].body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*" and isinstance(node, ast.ImportFrom) and node.module:
                    names |= set(declared(node.module, trees) or ())
                else:
                    names.add((alias.asname or alias.name).split(".")[0])
    return names


def taken(importer: str, trees: Mapping[str, ast.Module]) -> Iterator[Taken]:
    """Yield every name ``importer`` takes from another module of the house: in ``from m
    import name``, and as ``m.name`` where ``m`` names a module of the house it imported."""
    tree = trees[importer]
    modules: dict[str, str] = {}  # a name bound to a module of the house: that module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in trees:  # ``import a.b`` binds ``a``, ``import a.b as c`` a.b
                    module = alias.name if alias.asname else alias.name.split(".")[0]
                    modules[alias.asname or module] = module
        elif isinstance(node, ast.ImportFrom) and node.module in trees:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in trees:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module != importer:
                    yield Taken(importer, node.lineno, node.module, alias.name)

    def module_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return modules.get(node.id)
        if isinstance(node, ast.Attribute):
            dotted = f"{module_of(node.value)}.{node.attr}"
            return dotted if dotted in trees else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and module_of(node) is None:
            target = module_of(node.value)
            if target is not None and target != importer:
                yield Taken(importer, node.lineno, target, node.attr)


def is_private(module: str) -> bool:
    """Tell whether ``module`` or a package above it has a name with a leading underscore."""
    return any(part.startswith("_") for part in module.split("."))


def owner(module: str) -> str:
    """Return the package that owns a private ``module``: the one above its first private part."""
    parts = module.split(".")
    first = next(i for i, part in enumerate(parts) if part.startswith("_"))
    return ".".join(parts[:first])


def undeclared(trees: Mapping[str, ast.Module]) -> list[str]:
    """Return each public module that declares no ``__all__``."""
    return [m for m in trees if not is_private(m) and declared(m, trees) is None]


def unbound(trees: Mapping[str, ast.Module]) -> list[str]:
    """Return each name an ``__all__`` lists that its module does not bind."""
    return [
        f"{module}.{name}"
        for module in trees
        for name in declared(module, trees) or ()
        if name not in bound(module, trees)
    ]


def unexported(found: list[Taken], trees: Mapping[str, ast.Module]) -> list[str]:
    """Return each name in ``found`` that the module it is taken from does not export."""
    declarations = {module: declared(module, trees) for module in trees}
    wrong = []
    for one in found:
        exports = declarations[one.target]
        if one.name in ANY_MODULE:
            continue
        if exports is None and is_private(one.target):
            if (one.importer + ".").startswith(owner(one.target) + "."):
                continue
        elif exports is not None and one.name in exports:
            continue
        wrong.append(str(one))
    return wrong


def every_taken(trees: Mapping[str, ast.Module]) -> list[Taken]:
    """Return every name each module of ``trees`` takes from another."""
    return [found for importer in trees for found in taken(importer, trees)]


class TestExports:
    def test_every_module_declares_its_exports(self, house: dict[str, ast.Module]) -> None:
        """Each module of the three packages declares ``__all__`` or has a private name."""
        assert "lifecycle.orchestrator" in house
        assert undeclared(house) == []

    def test_every_exported_name_is_bound(self, house: dict[str, ast.Module]) -> None:
        """Each name in an ``__all__`` is one its module binds at import."""
        assert unbound(house) == []

    def test_modules_import_only_what_others_export(self, house: dict[str, ast.Module]) -> None:
        """No module takes from another a name that the other's ``__all__`` leaves out."""
        found = every_taken(house)
        assert len(found) > 1000, "the imports were not read"
        assert unexported(found, house) == []

    def test_the_commands_are_exported(self, house: dict[str, ast.Module]) -> None:
        """Each command pyproject.toml installs runs a name its module exports."""
        scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
        targets = [target.split(":") for target in scripts.values()]
        assert targets
        assert [m for m, name in targets if name not in (declared(m, house) or ())] == []

    def test_a_breach_of_each_rule_is_caught(self) -> None:
        """A module without ``__all__``, an export it lacks, a name taken that is not exported
        and a private module's name taken from outside its package are each named."""
        sources = {
            "lifecycle": "",
            "lifecycle.a": "__all__ = ['shown', 'gone']\nshown = hidden = 1\n",
            "lifecycle.b": (
                "from lifecycle.a import shown, hidden\n"
                "from lifecycle import a\n"
                "import lifecycle.a\n"
                "a.shown, a.hidden, lifecycle.a.hidden\n"
            ),
            "lifecycle._own": "x = 1\n",
            "lifecycle._own.c": "from lifecycle._own import x\n",
        }
        trees = {name: ast.parse(source) for name, source in sources.items()}
        outside = {**trees, "attention.d": ast.parse("from lifecycle._own import x\n")}
        assert undeclared(trees) == ["lifecycle", "lifecycle.b"]
        assert unbound(trees) == ["lifecycle.a.gone"]
        assert unexported(every_taken(outside), outside) == [
            "lifecycle.b:1 takes hidden from lifecycle.a",
            "lifecycle.b:4 takes hidden from lifecycle.a",
            "lifecycle.b:4 takes hidden from lifecycle.a",
            "attention.d:1 takes x from lifecycle._own",
        ]
