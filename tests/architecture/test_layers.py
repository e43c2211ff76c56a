"""The layering of docs/architecture.md, checked on the source: every import of a flashtune
module (at module level or inside a function) points down or stays inside its own area, the
package root is imported by nobody, and no two modules import each other in a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import flashtune

ROOT = Path(flashtune.__file__).resolve().parent

#: Areas from the bottom up; an area may import its own modules and any area below it.
#: Areas on one row are peers and may not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("flashtune._version", "flashtune.errors", "flashtune._lazy"),
    ("flashtune.settings",),
    ("flashtune.codegen", "flashtune.templates"),
    ("flashtune.toolchain",),
    ("flashtune.db", "flashtune.families"),
    ("flashtune.runtime",),
    ("flashtune.perf",),
    ("flashtune.api",),
    ("flashtune.tuner",),
    ("flashtune.commands",),
    ("flashtune.cli",),
)


def _area(module: str) -> str:
    for row in LAYERS:
        for area in row:
            if module == area or module.startswith(area + "."):
                return area
    raise AssertionError(f"{module} belongs to no area of LAYERS: add it to the table and "
                         "to docs/architecture.md")


def _rank(area: str) -> int:
    return next(i for i, row in enumerate(LAYERS) if area in row)


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join(parts), path


def _imports(module: str, path: Path) -> set[str]:
    """flashtune modules imported by ``module`` anywhere in its source (typing-only imports
    included: they are arrows of the design too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flashtune"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("flashtune"):
                continue
            for alias in node.names:  # `from pkg import module` names a module too
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in NAMES else base)
    return found


MODULES = list(_modules())
NAMES = {m for m, _ in MODULES}
GRAPH = {m: _imports(m, p) for m, p in MODULES}


def test_every_import_points_down_or_stays_in_its_area() -> None:
    upward = []
    for module, targets in GRAPH.items():
        if module == "flashtune":
            continue
        here = _area(module)
        for target in targets:
            if target == "flashtune":
                upward.append(f"{module} imports the package root (import the module itself)")
                continue
            there = _area(target)
            if there != here and _rank(there) >= _rank(here):
                upward.append(f"{module} ({here}) imports {target} ({there})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    edges = {m: {t for t in ts if t in NAMES and t != m} for m, ts in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_one_version_source() -> None:
    offenders = [m for m, p in MODULES if m != "flashtune._version"
                 and "__version__ =" in p.read_text()]
    assert not offenders, offenders
