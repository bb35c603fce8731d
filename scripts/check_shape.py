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
    """The modules of ``package`` (and of its sub-packages) that ``path`` imports, by dotted
    name below the package: ``from ft_launcher.hang import monitor`` counts ``hang.monitor``."""
    def is_module(dotted: str) -> bool:
        base = ROOT / package / dotted.replace(".", "/")
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] != package:
                continue
            below = ".".join(parts[1:])
            subs = [f"{below}.{a.name}".lstrip(".") for a in node.names]
            found = [m for m in subs if is_module(m)]
            names.update(found if found else [below])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package and len(parts) > 1:
                    names.add(".".join(parts[1:]))
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
