"""The shape rules (scripts/check_shape.py): no ft_launcher module importing more than 10
sibling modules, no import circle among them, no function over 60 lines in ft_launcher/ and
ft_agent/; and the cycle reaching its services through the seam alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import check_shape  # noqa: E402


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_shape.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_every_module_is_in_shape():
    done = _check()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "import circles: none" in done.stdout


def test_the_checker_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    path = tmp_path / "long.py"
    path.write_text(f"def f():\n{body}\n")
    done = _check(str(path))
    assert done.returncode == 1 and "function f has 62 lines" in done.stdout


def _package(tmp_path: Path, files: dict[str, str]) -> check_shape.Graph:
    for name, text in files.items():
        path = tmp_path / "ft_launcher" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [path.parent, *path.parent.parents]:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
        path.write_text(text)
    return check_shape.Graph.of_package(root=tmp_path)


def test_imports_are_counted_by_kind(tmp_path):
    graph = _package(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\n"
                "from ft_launcher import b, c\n"
                "from ft_launcher.sub.d import X\n"
                "if TYPE_CHECKING:\n    from ft_launcher.e import Y\n"
                "def f():\n    import ft_launcher.sub.f\n",
        "b.py": "", "c.py": "", "e.py": "", "sub/d.py": "X = 1\n", "sub/f.py": ""})
    assert graph.edges["a"] == {"b": "module", "c": "module", "sub.d": "module",
                                "e": "typing", "sub.f": "local"}
    assert graph.counts()["a"] == (4, 1)
    assert graph.circles() == []


@pytest.mark.parametrize("kind", ["module", "local", "typing"])
def test_a_circle_is_found_whatever_import_closes_it(tmp_path, kind):
    back = {"module": "from ft_launcher import a\n",
            "local": "def f():\n    from ft_launcher import a\n",
            "typing": "from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from ft_launcher.a import A\n"}[kind]
    graph = _package(tmp_path, {"a.py": "from ft_launcher import b\nA = 1\n",
                                "b.py": "from ft_launcher import c\n", "c.py": back})
    assert graph.circles() == [["a", "b", "c", "a"]]
    report, problems = check_shape.check_graph(graph)
    assert problems == [f"import circle: a -(module)-> b -(module)-> c -({kind})-> a"]


def test_a_module_over_the_limit_fails(tmp_path):
    many = {f"m{i}.py": "" for i in range(check_shape.MAX_SIBLINGS + 1)}
    hub = "".join(f"from ft_launcher import m{i}\n" for i in range(len(many)))
    _, problems = check_shape.check_graph(_package(tmp_path, {"hub.py": hub, **many}))
    assert len(problems) == 1 and problems[0].startswith(
        f"ft_launcher/hub: imports {check_shape.MAX_SIBLINGS + 1} sibling modules")


def test_the_cycle_reaches_its_services_through_the_seam_alone():
    imported = check_shape.imports_by_kind(ROOT / "ft_launcher" / "cycle.py")
    services = {m for m, kind in imported.items()
                if kind != check_shape.TYPING and m.startswith("services")}
    assert services == {"services.seam"}
    assert not {"snapshots", "stragglers", "warm", "observe"} & \
        {m.split(".")[0] for m in imported}
