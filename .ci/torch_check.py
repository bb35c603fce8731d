"""What .ci/run needs for a torch other than the README's, in a fresh virtualenv.

``python .ci/torch_check.py requirements [--without NAME ...]``: the test extras of
pyproject.toml, one a line, less the packages named (those that need a newer torch).

``python .ci/torch_check.py demo``: the README's demo command, less its install steps, run
from the repository root with this interpreter's commands; exits non-zero unless the run
recovered (exit code 0 after at least one restart).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
INSTALL_STEPS = ("python3 -m venv", ". .venv/bin/activate", "pip install")


def requirement_name(requirement: str) -> str:
    """``megatron-core==0.16.1`` -> ``megatron-core`` (normalised as pip compares names)."""
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_requirements(without: list[str]) -> list[str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    left_out = {requirement_name(n) for n in without}
    test = extras["optional-dependencies"]["test"]
    unknown = left_out - {requirement_name(r) for r in test}
    if unknown:
        raise SystemExit(f"not in the test extras: {', '.join(sorted(unknown))}")
    return [r for r in test if requirement_name(r) not in left_out]


def readme_demo() -> str:
    """The README's demo command (the first bash block after **Demo**), less its install
    steps: what a user runs once torch and the project are installed."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"\*\*Demo\*\*.*?```bash\n(.+?)\n```", text, re.DOTALL)
    if not found:
        raise SystemExit("README.md: no bash block after **Demo**")
    steps = [s.strip() for s in found.group(1).split(" && ")]
    kept = [s for s in steps if not s.startswith(INSTALL_STEPS)]
    if len(kept) == len(steps) or not any(s.startswith("ft_launcher ") for s in kept):
        raise SystemExit(f"README.md's demo is not install steps then ft_launcher: {steps}")
    return " && ".join(kept)


def run_demo() -> int:
    command = readme_demo()
    runs = ROOT / "ft_runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    print(f"$ {command}", flush=True)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, env=env,
                          timeout=600)
    new = sorted(set(runs.iterdir()) - before) if runs.exists() else []
    if done.returncode != 0 or len(new) != 1:
        print(f"demo: exit {done.returncode}, new run directories {new}")
        return 1
    summary = json.loads((new[0] / "summary.json").read_text())
    recovered = summary["exit_code"] == 0 and summary["restarts"] >= 1
    print(f"demo: exit code {summary['exit_code']} after {summary['restarts']} restart(s) "
          f"in {new[0].relative_to(ROOT)}: {'recovered' if recovered else 'NOT recovered'}")
    return 0 if recovered else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    req = sub.add_parser("requirements", help="the test extras, less the packages named")
    req.add_argument("--without", nargs="*", default=[], metavar="NAME")
    sub.add_parser("demo", help="run the README's demo and check that it recovered")
    args = parser.parse_args()
    if args.what == "requirements":
        print("\n".join(test_requirements(args.without)))
        return 0
    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
