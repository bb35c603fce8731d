"""The torch versions CI tests (read from ``.ci/run``, where they are written once) and the
skip of a test whose package needs a newer torch than the one installed.

``.ci/run`` runs the whole suite on the README's torch, and the fast tier on the oldest torch
the project supports and on the newest the registry serves; the venv of a torch older than
2.6 leaves out the test packages that need 2.6 (``NEEDS_TORCH_2_6`` there and here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

CI_RUN = Path(__file__).resolve().parents[1] / ".ci" / "run"

# Test packages that need torch 2.6 or later, and why; the module a test imports, by package.
NEEDS_TORCH_2_6 = {
    "megatron-core": ("megatron", "megatron-core 0.16.1 requires torch>=2.6"),
    "transformers": ("transformers", "transformers 5 refuses torch before 2.6 at run time"),
}


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``2.4.1+cu121`` -> (2, 4)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    assert found, version
    return int(found.group(1)), int(found.group(2))


TORCH = version_tuple(torch.__version__)


def ci_variables() -> dict[str, str]:
    """The ``NAME=value`` and ``NAME="a b"`` lines of ``.ci/run``."""
    found = re.findall(r'^([A-Z][A-Z0-9_]*)=(?:"([^"]*)"|(\S+))', CI_RUN.read_text(),
                       re.MULTILINE)
    return {name: quoted or plain for name, quoted, plain in found}


def readme_torch() -> tuple[int, int]:
    """The torch the README's commands install and the whole suite runs on."""
    return version_tuple(ci_variables()["TORCH_README"])


def skip_below_torch_2_6(package: str) -> None:
    """Skip the calling test where the installed torch is older than ``package`` needs; on
    2.6 and later the test imports the package as usual (a missing one fails it)."""
    _module, why = NEEDS_TORCH_2_6[package]
    if TORCH < (2, 6):
        pytest.skip(f"{package} not testable on torch {torch.__version__}: {why}",
                    allow_module_level=True)
