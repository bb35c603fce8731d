#!/usr/bin/env python3
"""The shape of ft_launcher: how many sibling modules each module imports, and import circles.

For every module of ``ft_launcher`` (sub-packages included) it prints how many sibling
modules it imports, by dotted name below the package (``from ft_launcher.hang import
monitor`` counts ``hang.monitor``). The count is of imports that run: at module level or
inside a function. Imports under ``if TYPE_CHECKING:`` run never; they are printed apart
(``+N typing``) and not counted against the limit.

It then looks for import circles among ft_launcher modules over every import: module level,
inside a function (a circle that only a function-local import breaks still ties the two
modules together) and TYPE_CHECKING-only (a circle in the types is one in the design). Each
circle is printed with the kind of each of its edges.

Exit 1 when a module imports more than ``MAX_SIBLINGS`` siblings, when there is a circle, or
when a function in the given files (default: everything under ft_launcher/ and ft_agent/) is
longer than ``MAX_FUNCTION`` lines. Classes have no length limit: a class is judged by what
it owns, not by a count of its lines.

Usage: ``python scripts/check_shape.py [FILE ...]`` (files: only the function rule for them).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ft_launcher"
MAX_FUNCTION = 60
MAX_SIBLINGS = 10

RUNTIME, LOCAL, TYPING = "module", "local", "typing"


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def violations(path: Path) -> list[str]:
    """Each function of ``path`` that is too long, as ``path:line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{rel}:{node.lineno}: function {node.name} has {_lines(node)} lines "
            f"(> {MAX_FUNCTION})"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and _lines(node) > MAX_FUNCTION]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of ``tree`` with its kind: RUNTIME (module level, or in a
    class body or a module-level ``if``/``try``), LOCAL (inside a function) or TYPING
    (under ``if TYPE_CHECKING:``)."""
    def walk(nodes: Iterable[ast.AST],
             kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, kind
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, TYPING)
                yield from walk(node.orelse, kind)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(ast.iter_child_nodes(node), TYPING if kind == TYPING else LOCAL)
            else:
                yield from walk(ast.iter_child_nodes(node), kind)
    yield from walk(ast.iter_child_nodes(tree), RUNTIME)


def _is_module(dotted: str, package: str, root: Path) -> bool:
    base = root / package / dotted.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _targets(node: ast.Import | ast.ImportFrom, package: str, root: Path) -> list[str]:
    """The modules of ``package`` one import statement names, below the package."""
    if isinstance(node, ast.ImportFrom):
        parts = (node.module or "").split(".")
        if node.level or parts[0] != package:
            return []
        below = ".".join(parts[1:])
        subs = [f"{below}.{a.name}".lstrip(".") for a in node.names]
        found = [m for m in subs if _is_module(m, package, root)]
        return found or ([below] if below else [])
    return [".".join(a.name.split(".")[1:]) for a in node.names
            if a.name.split(".")[0] == package and "." in a.name]


def imports_by_kind(path: Path, package: str = PACKAGE, root: Path = ROOT) -> dict[str, str]:
    """The sibling modules ``path`` imports -> the strongest kind of import (RUNTIME over
    LOCAL over TYPING); ``root`` holds the package."""
    rank = {RUNTIME: 0, LOCAL: 1, TYPING: 2}
    found: dict[str, str] = {}
    for node, kind in _imports(ast.parse(path.read_text(), str(path))):
        for target in _targets(node, package, root):
            if target not in found or rank[kind] < rank[found[target]]:
                found[target] = kind
    return found


def module_name(path: Path, package: str = PACKAGE, root: Path = ROOT) -> str:
    rel = path.relative_to(root / package).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@dataclass
class Graph:
    """ft_launcher's modules and their imports of each other."""

    edges: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> target: kind

    @classmethod
    def of_package(cls, package: str = PACKAGE, root: Path = ROOT) -> Graph:
        graph = cls()
        for path in sorted((root / package).rglob("*.py")):
            name = module_name(path, package, root)
            if name:  # the package's own __init__ is empty
                graph.edges[name] = {t: k for t, k in imports_by_kind(path, package, root).items()
                                     if t != name}
        return graph

    def counts(self) -> dict[str, tuple[int, int]]:
        """module -> (siblings imported where it runs, TYPE_CHECKING-only ones)."""
        return {m: (sum(k != TYPING for k in e.values()), sum(k == TYPING for k in e.values()))
                for m, e in self.edges.items()}

    def circles(self) -> list[list[str]]:
        """Every strongly connected group of two or more modules (each is at least one
        circle), as a closed path through the group, smallest module first."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        groups: list[list[str]] = []

        def visit(v: str) -> None:  # Tarjan's algorithm
            index[v] = low[v] = len(index)
            stack.append(v)
            for w in self.edges.get(v, {}):
                if w not in self.edges:
                    continue
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

        for v in sorted(self.edges):
            if v not in index:
                visit(v)
        return [self._path_through(g) for g in sorted(groups)]

    def _path_through(self, group: list[str]) -> list[str]:
        """A shortest circle through the group's first module (it closes on itself)."""
        start, members = group[0], set(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(self.edges[v]):
                    if w == start:
                        return paths[v] + [start]
                    if w in members and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        return group  # pragma: no cover - a strongly connected group always closes

    def describe(self, circle: list[str]) -> str:
        return " ".join(f"{a} -({self.edges[a][b]})->" for a, b in pairwise(circle)) \
            + f" {circle[-1]}"


def check_graph(graph: Graph) -> tuple[list[str], list[str]]:
    """(report lines, problems) for the sibling counts and the circles."""
    counts = graph.counts()
    order = sorted(counts, key=lambda m: (-counts[m][0], m))
    report = [f"sibling modules each module imports (at most {MAX_SIBLINGS}; TYPE_CHECKING-only "
              "ones apart):"]
    for m in order:
        runtime, typing = counts[m]
        report.append(f"  {runtime:3d}  {m}" + (f" (+{typing} typing)" if typing else ""))
    problems = [f"{PACKAGE}/{m.replace('.', '/')}: imports {counts[m][0]} sibling modules "
                f"(> {MAX_SIBLINGS}): "
                f"{', '.join(sorted(t for t, k in graph.edges[m].items() if k != TYPING))}"
                for m in order if counts[m][0] > MAX_SIBLINGS]
    circles = graph.circles()
    report.append("import circles: " + ("none" if not circles else str(len(circles))))
    problems += [f"import circle: {graph.describe(c)}" for c in circles]
    return report, problems


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or sorted(
        p for d in (PACKAGE, "ft_agent") for p in (ROOT / d).rglob("*.py"))
    problems = [v for f in files for v in violations(f)]
    if not argv:
        report, found = check_graph(Graph.of_package())
        print("\n".join(report))
        problems += found
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
