"""The house's arrows, held on the imports as written: ``lifecycle -> components -> attention``.

Every import of the three packages is read from its source (``ast``, nothing is imported),
at module level, inside functions and under ``if TYPE_CHECKING:`` alike: a type-only import
is an arrow too, and a failure says which kind it is. The sources are read by a fixture, not
at import: every xdist worker imports this file to collect it, and one runs it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("lifecycle", "components", "attention")
"""The packages top down: each imports only itself and those after it."""

OUTSIDE_CORE = ("lifecycle.serving", "lifecycle.cli", "lifecycle.__main__")
"""What serves the core: ``__main__`` is the CLI's entry point (``python -m lifecycle``)."""

ADMISSION_READS = (
    "lifecycle.spec",
    "lifecycle.plan",
    "lifecycle.refusals",
    "lifecycle.machines.tables",
)
"""What admission reads of the rest of ``lifecycle``: the spec (sizes too), the plan, refusals,
and the tables, whose ``Guard`` names the guard each refusal answers for."""

PROBE = ("lifecycle.admission.offload_dir", "lifecycle.offload_folder")
"""The one I/O admission does: the offload-dir check probes the folder it would write."""

ROOMS = {
    "lifecycle.machines": ("lifecycle.events", "lifecycle.logs", "lifecycle.refusals"),
    "lifecycle.spec": ("lifecycle.shown",),
    "lifecycle.device": (
        "lifecycle.machines",
        "lifecycle.spec",
        "lifecycle.admission",
        "lifecycle.offload_folder",
        "lifecycle.plan",
        "lifecycle.refusals",
        "lifecycle.events",
        "lifecycle.logs",
    ),
    "lifecycle.pictures": (
        "lifecycle.machines",
        "lifecycle.spec",
        "lifecycle.plan",
        "lifecycle.refusals",
        "lifecycle.events",
    ),
}
"""Each room of ``lifecycle`` and what else of ``lifecycle`` it may import: the machines
know no device, orchestrator or spec; the spec knows no machine (it reads one helper
that cuts values short in errors); the device knows no orchestrator, request or
adapter keeper, and admission knows no device (``offload_folder`` stays below
both); pictures only read the machines, the spec and what
admission and the orchestrator report."""

ONE_WAY = (
    ("components.recipes", "components.folders"),
    ("components.kinds", "components.models"),
)
"""Rooms of ``components`` that import one another one way only: a recipe reads a folder
(a folder never names a recipe), a kind builds our models (a model knows no kind)."""

IO_MODULES = (
    "asyncio",
    "http",
    "logging",
    "multiprocessing",
    "shutil",
    "socket",
    "structlog",
    "subprocess",
    "tempfile",
    "threading",
    "torch.distributed",
    "urllib",
)
"""Libraries that write, log, talk or start work: admission decides, and does none of it."""


class Import(NamedTuple):
    """One imported module, as a line of the importer names it."""

    importer: str
    target: str
    line: int
    typing_only: bool

    def __str__(self) -> str:
        kind = " (under TYPE_CHECKING)" if self.typing_only else ""
        return f"{self.importer}:{self.line} imports {self.target}{kind}"


def module_name(path: Path) -> str:
    """Return the dotted name of the module at ``path`` (an ``__init__`` is its package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = frozenset(module_name(p) for floor in FLOORS for p in (ROOT / floor).rglob("*.py"))
"""Every module of the house, by dotted name."""


def is_type_checking(test: ast.expr) -> bool:
    """Tell whether an ``if`` test is ``TYPE_CHECKING`` (bare or as ``typing.TYPE_CHECKING``)."""
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def imports_of(path: Path) -> list[Import]:
    """Return every module the file at ``path`` imports."""
    return read_imports(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def read_imports(source: str, importer: str, *, is_package: bool = False) -> list[Import]:
    """Return every module ``source`` (the module ``importer``) imports, each line once."""
    package = importer if is_package else importer.rpartition(".")[0]

    def visit(node: ast.AST, typing_only: bool) -> Iterator[Import]:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, True)
            for child in node.orelse:
                yield from visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, node.lineno, typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *filter(None, [node.module])])
            # ``from a import b``: b is the module a.b where there is one (a package's
            # ``__init__`` runs anyway), else a name of a; outside the house, both
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target not in MODULES:
                    yield Import(importer, base, node.lineno, typing_only)
                if target in MODULES or base.split(".")[0] not in FLOORS:
                    yield Import(importer, target, node.lineno, typing_only)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, typing_only)

    return list(dict.fromkeys(visit(ast.parse(source), False)))


def within(name: str, *prefixes: str) -> bool:
    """Tell whether module ``name`` is one of ``prefixes`` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def floor(name: str) -> int:
    """Return the floor of module ``name`` (0: the top, ``lifecycle``)."""
    return FLOORS.index(name.split(".")[0])


def room_breaches(imports: list[Import]) -> list[str]:
    """Return each import of a room of ``lifecycle`` that reaches outside what it may read."""
    return [
        str(found)
        for found in imports
        for room, reads in ROOMS.items()
        if within(found.importer, room)
        and within(found.target, "lifecycle")
        and not within(found.target, room, *reads)
    ]


def terminal_writes(source: str, module: str) -> list[str]:
    """Return each place in ``source`` that prints to the process's own stdout or stderr, or
    ends the process through ``sys.exit``: what a command does, not a library."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            stream = next((k.value for k in node.keywords if k.arg == "file"), None)
            if stream is None or ast.unparse(stream) in ("sys.stdout", "sys.stderr"):
                found.append(f"{module}:{node.lineno} prints to the terminal")
        elif isinstance(node, ast.Attribute) and ast.unparse(node) in (
            "sys.exit",
            "sys.stdout.write",
            "sys.stderr.write",
        ):
            found.append(f"{module}:{node.lineno} calls {ast.unparse(node)}")
    return found


def package_imports(*packages: str) -> list[Import]:
    """Return every import of every module of ``packages``."""
    return [
        found
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        for found in imports_of(path)
    ]


@pytest.fixture(scope="module")
def every_import() -> list[Import]:
    """Every import of every module of the house."""
    return package_imports(*FLOORS)


class TestArrows:
    def test_the_reader_sees_every_kind_of_import(self) -> None:
        """Function-level, relative and type-only imports are read (else the rest proves little)."""
        source = (
            "from typing import TYPE_CHECKING\n"
            "from . import sibling\n"
            "from lifecycle import spec, logs\n"
            "if TYPE_CHECKING:\n"
            "    from components.loader import LoaderPath\n"
            "def late() -> None:\n"
            "    import lifecycle.cli\n"
        )
        found = {(i.target, i.line, i.typing_only) for i in read_imports(source, "attention.x.y")}
        assert ("attention.x", 2, False) in found
        assert {("lifecycle.spec", 3, False), ("lifecycle.logs", 3, False)} <= found
        assert ("lifecycle", 3, False) not in found  # the modules, not their package
        assert ("components.loader", 5, True) in found
        assert ("lifecycle.cli", 7, False) in found

    def test_packages_import_downward_only(self, every_import: list[Import]) -> None:
        """``lifecycle -> components -> attention``: no package imports one above it."""
        upward = [
            str(found)
            for found in every_import
            if found.target.split(".")[0] in FLOORS and floor(found.target) < floor(found.importer)
        ]
        assert upward == []

    def test_the_core_never_imports_serving_or_the_cli(self, every_import: list[Import]) -> None:
        """The core (``lifecycle`` but ``serving/`` and ``cli/``) imports neither of those."""
        core = [found for found in every_import if within(found.importer, "lifecycle")]
        core = [found for found in core if not within(found.importer, *OUTSIDE_CORE)]
        assert core, "no module of the core was read"
        assert [str(f) for f in core if within(f.target, *OUTSIDE_CORE[:2])] == []

    def test_serving_leaves_the_terminal_and_exit_codes_to_the_cli(
        self, every_import: list[Import]
    ) -> None:
        """The HTTP worker neither prints to the terminal nor imports the CLI (its exit codes):
        ``lifecycle serve`` says what went wrong and how the process ends."""
        paths = sorted((ROOT / "lifecycle" / "serving").rglob("*.py"))
        assert paths, "no module of serving was read"
        writes = [w for p in paths for w in terminal_writes(p.read_text(), module_name(p))]
        serving = [f for f in every_import if within(f.importer, "lifecycle.serving")]
        assert writes == []
        assert [str(f) for f in serving if within(f.target, "lifecycle.cli")] == []

    def test_a_write_to_the_terminal_is_caught(self) -> None:
        """Printing to stderr or stdout, or ``sys.exit``, is named; printing to a given stream
        is not (the rule can fail)."""
        source = (
            "import sys\n"
            "print('x', file=sys.stderr)\n"
            "print('y')\n"
            "print('z', file=announce)\n"
            "sys.exit(2)\n"
        )
        assert terminal_writes(source, "m") == [
            "m:2 prints to the terminal",
            "m:3 prints to the terminal",
            "m:5 calls sys.exit",
        ]

    def test_admission_does_no_io_but_the_offload_dir_probe(
        self, every_import: list[Import]
    ) -> None:
        """Admission decides: of ``lifecycle`` it reads the spec, plan, refusals, sizes and
        tables, and imports nothing that writes, logs or starts work; ``offload_dir`` alone
        probes a folder.
        """
        admission = [f for f in every_import if within(f.importer, "lifecycle.admission")]
        assert admission, "no module of admission was read"
        allowed = ("lifecycle.admission", *ADMISSION_READS)
        wrong = [
            str(found)
            for found in admission
            if within(found.target, *IO_MODULES)
            or (
                within(found.target, "lifecycle")
                and not within(found.target, *allowed)
                and not (found.importer == PROBE[0] and within(found.target, PROBE[1]))
            )
        ]
        assert wrong == []

    def test_rooms_import_only_what_they_may_read(self, every_import: list[Import]) -> None:
        """Each room of ``lifecycle`` imports only itself and the parts ``ROOMS`` lets it read."""
        assert all(any(within(f.importer, room) for f in every_import) for room in ROOMS), (
            "a room is empty"
        )
        assert room_breaches(every_import) == []

    def test_a_room_reaching_outside_is_caught(self) -> None:
        """An import from a room to a part it may not read is named (the rule can fail)."""
        wrong = read_imports(
            "from lifecycle.orchestrator import Orchestrator\n", "lifecycle.machines.x"
        )
        allowed = read_imports(
            "from lifecycle.machines.engine import Guarded\n", "lifecycle.pictures.x"
        )
        assert room_breaches(wrong) == [
            "lifecycle.machines.x:1 imports lifecycle.orchestrator",
        ]
        assert room_breaches(allowed) == []

    def test_rooms_of_components_import_one_way(self, every_import: list[Import]) -> None:
        """Recipes import folders and kinds import models, never the other way round."""
        back = [
            str(found)
            for found in every_import
            for upper, lower in ONE_WAY
            if within(found.importer, lower) and within(found.target, upper)
        ]
        assert all(any(within(f.importer, lower) for f in every_import) for _, lower in ONE_WAY)
        assert back == []

    def test_kinds_do_not_import_the_registry_that_lists_them(
        self, every_import: list[Import]
    ) -> None:
        """The built-in kinds know nothing of ``components.registry``: no import cycle."""
        kinds = [f for f in every_import if within(f.importer, "components.kinds")]
        assert kinds, "no module of components.kinds was read"
        assert [str(f) for f in kinds if within(f.target, "components.registry")] == []
