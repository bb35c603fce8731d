"""The exit hook of cold workers (``sitecustomize.py`` in this directory, see there)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
ORIGINAL = "FT_COLD_EXIT_PYTHONPATH"  # what the hook puts back as PYTHONPATH ("-": unset)


def _site_runs(flags: list[str]) -> bool:
    """Whether an interpreter started with these options imports ``sitecustomize`` from
    ``PYTHONPATH``: not with -S (no ``site``), -E or -I (no ``PYTHON*`` variables)."""
    for flag in flags:
        if flag in ("-m", "-c") or not flag.startswith("-"):
            break
        if not flag.startswith("--") and any(c in "EIS" for c in flag[1:]):
            return False
    return True


def exit_hook_env(argv: list[str], env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a cold worker, with the exit hook on ``PYTHONPATH`` when ``argv`` runs
    this interpreter (a Python entrypoint, as the launcher builds it) in a way that loads
    it; else ``env`` unchanged."""
    out = dict(env)
    if not argv or argv[0] != sys.executable or not _site_runs(argv[1:]):
        return out
    original = out.get("PYTHONPATH")
    out[ORIGINAL] = "-" if original is None else original
    out["PYTHONPATH"] = HOOK_DIR if not original else f"{HOOK_DIR}{os.pathsep}{original}"
    return out
