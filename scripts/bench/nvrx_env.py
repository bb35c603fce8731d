"""The NVRx baseline's own virtualenv, created on first use and reused afterwards.

``nvidia-resiliency-ext`` comes from the package registry into ``.bench/nvrx-venv`` at the
repository root (git-ignored), next to ``torch==2.13.0`` so both launchers run the same torch.
The project's own environment is never touched, and NVRx's launcher runs with NVRx's client.

    python scripts/bench/nvrx_env.py          # create or check it, print the launcher's path
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench")

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".bench" / "nvrx-venv"
TORCH_REQ = "torch==2.13.0"
NVRX_REQ = "nvidia-resiliency-ext==0.4.1"
MARKER = "bench-requirements.json"  # written last: a half-made venv is rebuilt, never used
INSTALL_TIMEOUT_S = 1800


@dataclass(frozen=True)
class NvrxEnv:
    """Paths of the NVRx baseline's interpreter and launcher."""

    venv: Path
    python: Path
    launcher: Path
    version: str


class NvrxEnvError(RuntimeError):
    """The NVRx virtualenv could not be created or is unusable."""


def _requirements() -> list[str]:
    reqs = [TORCH_REQ, NVRX_REQ]
    try:
        # torch imports numpy when present; the same numpy on both sides keeps the
        # workers' import time comparable.
        reqs.append(f"numpy=={importlib.metadata.version('numpy')}")
    except importlib.metadata.PackageNotFoundError:
        pass
    return reqs


def _ready(venv: Path) -> bool:
    marker = venv / MARKER
    try:
        return json.loads(marker.read_text()).get("requirements") == _requirements()
    except (OSError, ValueError):
        return False


def _run(argv: list[str]) -> None:
    log.info("nvrx venv: %s", " ".join(argv))
    try:
        subprocess.run(argv, check=True, timeout=INSTALL_TIMEOUT_S,
                       stdout=subprocess.DEVNULL if not log.isEnabledFor(logging.DEBUG) else None)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise NvrxEnvError(f"creating {VENV} failed: {exc}") from None


def ensure(venv: Path = VENV) -> NvrxEnv:
    """Create (or reuse) the NVRx virtualenv and return its paths."""
    python = venv / "bin" / "python"
    if not _ready(venv):
        if not python.exists():
            # The base interpreter, not this venv's: a venv made from a venv would still
            # be independent, but being explicit keeps the two environments apart.
            base = getattr(sys, "_base_executable", sys.executable)
            _run([base, "-m", "venv", str(venv)])
        _run([str(python), "-m", "pip", "install", "--quiet", *_requirements()])
        (venv / MARKER).write_text(json.dumps({"requirements": _requirements()}))
    launcher = venv / "bin" / "ft_launcher"
    if not launcher.exists():
        raise NvrxEnvError(f"{launcher} missing after installing {NVRX_REQ}")
    version = NVRX_REQ.split("==")[1]
    return NvrxEnv(venv=venv, python=python, launcher=launcher, version=version)


def main() -> None:
    """Create or check the venv and print where its launcher is."""
    logging.basicConfig(level=logging.INFO, format="[bench %(asctime)s] %(message)s")
    try:
        env = ensure()
    except NvrxEnvError as exc:
        sys.exit(f"error: {exc}")
    print(env.launcher)


if __name__ == "__main__":
    main()
