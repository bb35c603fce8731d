"""The user documentation: generated pages current, every event named in one table, links and
anchors that resolve, every page reachable from the README, and the getting-started page's
runnable blocks run as written."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ft_launcher.events import EVENTS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
RENDER = "python -m scripts.docs.render"
RUNNABLE = "bash runnable"  # the info string of a fenced block the tests run


def _load_renderer():
    # By path: tests/scripts/ would shadow the repository's scripts/ as a package name.
    spec = importlib.util.spec_from_file_location("_docs_render",
                                                  ROOT / "scripts" / "docs" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_renderer()


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# -- generated pages --------------------------------------------------------------------


def test_generated_pages_equal_what_the_renderer_writes():
    stale = [path for path, text in render.render_all().items()
             if not (ROOT / path).exists() or (ROOT / path).read_text() != text]
    assert not stale, f"{', '.join(stale)} out of date: run `{RENDER}` and commit the result"


def test_the_renderer_is_deterministic():
    assert render.render_all() == render.render_all()


# -- the event table --------------------------------------------------------------------

EMITTERS = {"event", "events", "_emit"}


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _names_of(expr: ast.expr, constants: dict[str, str]) -> list[str] | None:
    """The event names an expression can take, or None when it is not resolvable here."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, ast.Name) and expr.id in constants:
        return [constants[expr.id]]
    if isinstance(expr, ast.IfExp):
        a, b = _names_of(expr.body, constants), _names_of(expr.orelse, constants)
        return None if a is None or b is None else a + b
    return None


def _passed_on(func: ast.AST) -> set[str]:
    """Names in a function that carry an event name recorded elsewhere: its parameters (a
    helper that passes its caller's name on) and its for-loop targets (held events
    replayed)."""
    args = func.args  # type: ignore[attr-defined]
    out = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    for node in ast.walk(func):
        if isinstance(node, ast.For):
            out |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return out


def emitted_events() -> tuple[set[str], list[str]]:
    """Event names the launcher writes, found in its source: the first argument of every
    ``event(...)`` / ``events(...)`` / ``_emit(...)`` call, and the event of every
    ``...Event(...)`` record (the straggler detector's transitions, emitted as
    ``self.event(ev.event, ...)``). A call whose name is neither a literal, a module
    constant, a name passed on (a parameter, or held events replayed in a loop) nor a
    record's ``.event`` is returned as unresolved."""
    names: set[str] = set()
    unresolved: list[str] = []
    for path in sorted((ROOT / "ft_launcher").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = _constants(tree)
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))]
        for func in funcs:
            params = _passed_on(func)
            for node in ast.walk(func):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                callee = node.func
                called = callee.attr if isinstance(callee, ast.Attribute) else \
                    callee.id if isinstance(callee, ast.Name) else ""
                first = node.args[0]
                if called.endswith("Event") and called[:1].isupper():
                    found = _names_of(first, constants)
                    if found is None:
                        unresolved.append(f"{path.name}:{node.lineno}")
                    else:
                        names.update(found)
                    continue
                if called not in EMITTERS:
                    continue
                found = _names_of(first, constants)
                if found is not None:
                    names.update(found)
                elif isinstance(first, ast.Name) and first.id in params:
                    continue  # a name passed on: found where it was first given
                elif isinstance(first, ast.Attribute) and first.attr == "event":
                    continue  # a record's event: found at the record's construction
                else:
                    unresolved.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:60]}")
    return names, unresolved


def test_every_event_the_launcher_emits_is_in_the_table_and_no_other():
    names, unresolved = emitted_events()
    assert not unresolved, f"event names this test cannot resolve: {unresolved}"
    assert len(names) > 30, "the scan found too few events: is the emitter renamed?"
    missing = sorted(names - set(EVENTS))
    unused = sorted(set(EVENTS) - names)
    assert not missing, (f"emitted but not in ft_launcher/events.py: {missing}; add them, "
                         f"then run `{RENDER}`")
    assert not unused, f"in ft_launcher/events.py but never emitted: {unused}"


def test_the_scan_finds_a_literal_a_constant_and_a_record():
    source = ("X = 'from_constant'\n"
              "def f(self, flag):\n"
              "    self.event('literal', a=1)\n"
              "    self.events(X)\n"
              "    StragglerEvent('a' if flag else X, 1)\n")
    tree = ast.parse(source)
    constants = _constants(tree)
    call = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    found = {name for c in call for name in (_names_of(c.args[0], constants) or [])}
    assert found == {"literal", "from_constant", "a"}


# -- links and anchors ------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def _prose(text: str, inline_code: bool = False) -> str:
    """The page without its fenced code blocks and, unless ``inline_code``, its inline code
    (links there are not links)."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fence is None or m.group(2).startswith(fence)):
            fence = m.group(2)[0] * 3 if fence is None else None
            out.append("")
            continue
        out.append("" if fence else line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for line in _prose(path.read_text(), inline_code=True).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        name = base if not seen[base] else f"{base}-{seen[base]}"
        seen[base] += 1
        out.add(name)
    for m in re.finditer(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()):
        out.add(m.group(1))
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(path.read_text()))]


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    where, _, anchor = target.partition("#")
    return ((page.parent / where).resolve() if where else page), anchor


def test_slug_follows_github():
    assert slug("Exit codes and the policy") == "exit-codes-and-the-policy"
    assert slug("`ft_agent`: the training side") == "ft_agent-the-training-side"
    assert slug("Scaling to 1,000 nodes, on paper") == "scaling-to-1000-nodes-on-paper"
    assert slug("Runs (`results.json`)") == "runs-resultsjson"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in _pages():
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            dest, anchor = _resolve(page, target)
            rel = page.relative_to(ROOT)
            if not dest.exists():
                broken.append(f"{rel}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel}: {target} (no heading with anchor #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = {README.resolve()}, [README]
    while todo:
        page = todo.pop()
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            dest, _ = _resolve(page, target)
            if dest.suffix == ".md" and dest.exists() and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    orphans = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p.resolve() not in seen]
    assert not orphans, f"not reachable from README.md: {orphans}"


# -- what the README and guide may say --------------------------------------------------

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b\d\d:\d\d UTC\b")
ISSUE = re.compile(r"\bissues? #?\d+\b|\(#\d+\)", re.IGNORECASE)
DIARY = re.compile(r"this morning|yesterday|other engineers|shared with other|"
                   r"this 2-core machine|suite took|\bminutes? on 2\b", re.IGNORECASE)


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"


def test_no_dates_issue_numbers_or_diary_outside_the_generated_benchmarks():
    found = []
    generated = {ROOT / p for p in render.PAGES}
    for page in _pages():
        if page in generated:
            continue  # dates of the committed results, rendered from them
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for rx in (DATE, ISSUE, DIARY):
                m = rx.search(line)
                if m:
                    found.append(f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not found, "history belongs in commit messages:\n" + "\n".join(found)


def test_the_readme_holds_no_measured_figure():
    # Figures change when a benchmark is re-run: the README links to docs/benchmarks.md.
    text = _prose(README.read_text())
    figures = re.findall(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us|MB|MiB|%)(?![\w-])|×\d", text)
    assert not figures, f"measured figures in README.md: {figures}"


# -- runnable blocks --------------------------------------------------------------------


def runnable_blocks(path: Path) -> list[str]:
    blocks, current = [], None
    for line in path.read_text().splitlines():
        if current is None and line.strip() == f"```{RUNNABLE}":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    assert current is None, f"{path.name}: a runnable block is not closed"
    return blocks


def test_getting_started_has_runnable_blocks_without_network():
    blocks = runnable_blocks(DOCS / "getting-started.md")
    assert blocks
    for block in blocks:
        assert not re.search(r"\b(pip|curl|wget|apt-get|git clone)\b", block), block


def _commands(bin_dir: Path) -> None:
    """The project's console scripts (pyproject.toml), run by this interpreter from this
    checkout: another package's script of the same name in the environment (NVRx installs an
    ``ft_launcher`` too) must not answer for ours."""
    table = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    table = table.split("\n[", 1)[0]  # up to the next table (tomllib needs Python 3.11)
    scripts = dict(re.findall(r'^(\S+)\s*=\s*"([\w.]+:\w+)"', table, re.MULTILINE))
    assert "ft_launcher" in scripts, table
    bin_dir.mkdir()
    for name, target in scripts.items():
        module, func = target.split(":")
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\n"
                        f"sys.exit({func}())\n")
        path.chmod(0o755)


def _run_block(block: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    # A fresh directory with what a checkout gives the reader (the examples), the
    # project's commands on PATH, and this checkout's code importable.
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    _commands(tmp_path / ".bin")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(tmp_path / ".bin"), str(Path(sys.executable).parent),
                                   env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_getting_started_runnable_blocks_run_in_a_fresh_directory(tmp_path):
    for i, block in enumerate(runnable_blocks(DOCS / "getting-started.md")):
        where = tmp_path / f"block_{i}"
        where.mkdir()
        done = _run_block(block, where, timeout=600)
        assert done.returncode == 0, (f"block {i} exited {done.returncode}:\n{block}\n"
                                      f"--- stdout\n{done.stdout[-4000:]}\n"
                                      f"--- stderr\n{done.stderr[-4000:]}")
        summaries = [json.loads(p.read_text()) for p in where.glob("ft_runs/*/summary.json")]
        if "--ft-simulated-fault" in block:  # the page says the fault is recovered from
            assert summaries and all(x["exit_code"] == 0 for x in summaries), summaries
            assert any(x["restarts"] >= 1 for x in summaries), summaries
