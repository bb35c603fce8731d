#!/usr/bin/env python3
"""Prints every class over 300 lines and every function over 60 lines (by ``ast``) in the
given Python files (default: everything under ft_launcher/ and ft_agent/), and how many
sibling ft_launcher modules ft_launcher/supervisor.py imports (at most 10). Exit 1 on any
violation."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS = 300
MAX_FUNCTION = 60
MAX_SUPERVISOR_IMPORTS = 10
SUPERVISOR = ROOT / "ft_launcher" / "supervisor.py"


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def violations(path: Path) -> list[str]:
    """Each class and function of ``path`` that is too long, as ``path:line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _lines(node) > MAX_CLASS:
            found.append(f"{rel}:{node.lineno}: class {node.name} has {_lines(node)} lines "
                         f"(> {MAX_CLASS})")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                _lines(node) > MAX_FUNCTION:
            found.append(f"{rel}:{node.lineno}: function {node.name} has {_lines(node)} "
                         f"lines (> {MAX_FUNCTION})")
    return found


def sibling_imports(path: Path, package: str = "ft_launcher") -> set[str]:
    """The modules of ``package`` that ``path`` imports (``from package import x`` counts
    ``x`` when it is a module of the package)."""
    modules = {p.stem for p in (ROOT / package).glob("*.py")} | \
        {p.name for p in (ROOT / package).iterdir() if p.is_dir()}
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] != package:
                continue
            if len(parts) > 1:
                names.add(parts[1])
            else:
                names.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package and len(parts) > 1:
                    names.add(parts[1])
    return names


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or sorted(
        p for d in ("ft_launcher", "ft_agent") for p in (ROOT / d).rglob("*.py"))
    problems = [v for f in files for v in violations(f)]
    if SUPERVISOR in files or not argv:
        imported = sibling_imports(SUPERVISOR)
        print(f"ft_launcher/supervisor.py imports {len(imported)} sibling modules: "
              f"{', '.join(sorted(imported))}")
        if len(imported) > MAX_SUPERVISOR_IMPORTS:
            problems.append(f"ft_launcher/supervisor.py imports {len(imported)} sibling "
                            f"modules (> {MAX_SUPERVISOR_IMPORTS})")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
