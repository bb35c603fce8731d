"""Optional dependencies (the package's extras), imported when a feature first needs them."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(RuntimeError):
    """An optional dependency that a requested feature needs is not installed."""


def import_extra(modules: tuple[str, ...], feature: str, package: str,
                 extra: str) -> list[ModuleType]:
    """Import ``modules`` (all from ``package``), or raise :class:`MissingExtra` naming the
    ``feature`` that needs them and the extra that installs them."""
    try:
        return [importlib.import_module(name) for name in modules]
    except ImportError:
        raise MissingExtra(f"{feature} needs {package}: "
                           f"pip install 'ft-launcher[{extra}]'") from None
