"""The shape rules (scripts/check_shape.py) on the modules that meet them: no class over 300
lines, no function over 60 in ft_launcher/ and ft_agent/, and the supervisor importing at
most 10 sibling modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_in_shape():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_shape.py")],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_checker_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    path = tmp_path / "long.py"
    path.write_text(f"def f():\n{body}\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_shape.py"),
                           str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "function f has 62 lines" in done.stdout
