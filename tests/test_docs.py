"""The user documentation: generated pages current, every event named in one table, links and
anchors that resolve, every page reachable from the README, and the getting-started page's
runnable blocks run as written."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch_helpers import NO_PRELOADS, finish, launcher_cmd

from ft_launcher.events import EVENTS
from ft_launcher.nodes.rendezvous import free_port

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


def test_a_fragment_is_rendered_between_its_markers_and_a_missing_one_stops_the_renderer():
    source, _ = render.FRAGMENTS["README.md"]["dependencies"]
    begin, end = render.fragment_markers("dependencies", source)
    stale = f"before\n<!-- begin generated: dependencies (old) -->\nold list\n{end}\nafter\n"
    fresh = render.with_fragments("README.md", stale)
    assert fresh.startswith(f"before\n{begin}\n- Dependencies: ") and "old list" not in fresh
    assert fresh.endswith(f"{end}\nafter\n")
    with pytest.raises(SystemExit, match="expected one fragment 'dependencies'"):
        render.with_fragments("README.md", "the list, without its markers\n")


def test_every_dependency_and_extra_of_pyproject_is_on_the_pages():
    project = render._pyproject()
    readme = " ".join(README.read_text().split())
    started = (DOCS / "getting-started.md").read_text()
    for req in project["dependencies"]:
        assert f"`{req}`" in readme, req
    for extra, reqs in project["optional-dependencies"].items():
        assert f"`[{extra}]`" in readme and f"- `[{extra}]`: " in started, extra
        for req in reqs if extra == "test" else ():
            assert f"`{req}`" in readme, req


# -- the workers' environment and the run directory, against real launches ---------------


def _documented_env() -> set[str]:
    torchrun, ours = render.worker_env_tables()
    return {name for row in (*torchrun, *ours) for name in row.names}


def _launcher_env(documented: set[str], **extra: str) -> dict[str, str]:
    # The launcher's own environment without any documented variable, so every one a
    # worker has was set by the launcher or given here.
    return {**{k: v for k, v in os.environ.items() if k not in documented}, **extra}


def _probe(where: Path, launcher_args: tuple[str, ...], script_args: tuple[str, ...],
           env: dict[str, str]) -> tuple[Path, list[dict]]:
    """Run the probe script under a real launcher: its run directory, and every worker's
    environment of every cycle."""
    out, run_dir = where / "env", where / "run"
    out.mkdir()
    proc = subprocess.Popen(
        launcher_cmd(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", *launcher_args,
                     str(ROOT / "tests" / "scripts" / "docs_probe.py"), str(out), *script_args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    output = finish(proc, 120)
    assert proc.returncode == 0, output[-3000:]
    return run_dir, [json.loads(p.read_text()) for p in sorted(out.glob("cycle_*.json"))]


# (launcher options, script options, variables given to the launcher). The first turns on
# what sets a variable only in some jobs: TORCH_NCCL_TRACE_BUFFER_SIZE the flight recorder's
# variables, --virtual-local-rank FT_LOCAL_RANK and CUDA_VISIBLE_DEVICES, an armed rank_slow
# FT_SIMULATED_FAULT for its victim (due 600 s after the spawn, it never fires). The second
# hangs once, so its run directory has stacks and a second cycle.
STATIC_LAUNCHES = (
    (("--virtual-local-rank", "--ft-simulated-fault", "rank_slow:factor=2,base_delay=600,rank=1"),
     (), {"TORCH_NCCL_TRACE_BUFFER_SIZE": "1"}),
    (("--max-restarts", "1", "--ft-rank-heartbeat-timeout", "1"), ("--hang",), {}),
)


@pytest.fixture(scope="module")
def static_launches(tmp_path_factory) -> list[tuple[Path, list[dict], set[str]]]:
    """Each launch of STATIC_LAUNCHES: its run directory, every worker's environment, and
    the variables its workers got from the launcher (those the test gave it left out)."""
    documented, runs = _documented_env(), []
    for i, (launcher_args, script_args, extra) in enumerate(STATIC_LAUNCHES):
        env = _launcher_env(documented, **extra)
        run_dir, envs = _probe(tmp_path_factory.mktemp(f"docs_probe_{i}"), launcher_args,
                               script_args, env)
        assert envs, "the probe wrote no environment"
        runs.append((run_dir, envs, {k for e in envs for k in e} - set(env)))
    return runs


def test_every_variable_a_worker_gets_is_documented_and_every_documented_one_is_set(
        static_launches):
    from ft_launcher.peers import PEER_ENV

    got = set().union(*(added for _, _, added in static_launches))
    # Only where the rendezvous can drop a node (the slow case below, with c10d).
    expected = _documented_env() - {n for row in PEER_ENV for n in row.names}
    assert not got - expected, (f"workers get {sorted(got - expected)}, which "
                                "docs/reference/environment.md does not list: add an EnvDoc "
                                f"row next to the code that sets it, then run `{RENDER}`")
    assert not expected - got, (f"documented but no worker got them: {sorted(expected - got)}"
                                "; remove the row, or have this test turn on what sets them")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["c10d", "torch-c10d"])
def test_with_a_dynamic_rendezvous_every_documented_variable_is_set(tmp_path, backend):
    """The rendezvous that can drop a node adds its own (PEER_ENV); torch's, one more."""
    documented = _documented_env()
    if backend == "c10d":
        documented -= {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env = _launcher_env(documented, TORCH_NCCL_TRACE_BUFFER_SIZE="1")
    port = free_port()
    _, envs = _probe(tmp_path, (*STATIC_LAUNCHES[0][0], "--rdzv-backend", backend,
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "1"),
                     (), env)
    got = {k for e in envs for k in e} - set(env)
    assert got == documented, (f"not documented: {sorted(got - documented)}; documented, not "
                               f"set: {sorted(documented - got)}")


def test_every_ft_variable_in_the_code_is_documented():
    """A variable set only in a case no launch above turns on is still caught by its name:
    every FT_* and TORCHELASTIC_* string in ft_launcher/ and ft_agent/ is a documented one."""
    pattern = re.compile(r"""["'](FT_[A-Z0-9_]+|TORCHELASTIC_[A-Z0-9_]+)["']""")
    found = {m.group(1) for package in ("ft_launcher", "ft_agent")
             for path in (ROOT / package).rglob("*.py")
             for m in pattern.finditer(path.read_text())}
    assert len(found) > 10, "the scan found too few variables: are they named elsewhere?"
    # The cold workers' exit hook takes its variable back out before the script runs (its
    # own test asserts the script sees none of it): not part of a worker's environment.
    from ft_launcher.process.cold_exit import ORIGINAL

    undocumented = found - _documented_env() - {ORIGINAL}
    assert not undocumented, sorted(undocumented)


def _path_pattern(documented: str, contents: bool = True) -> re.Pattern:
    """A documented path as a pattern: <n> and <r> any number; a directory (a trailing /)
    with everything in it, unless ``contents`` is False."""
    text = re.escape(documented).replace("<n>", r"\d+").replace("<r>", r"\d+")
    return re.compile(text + (".*" if documented.endswith("/") and contents else ""))


def test_every_path_a_run_leaves_is_documented_and_every_documented_one_is_made(
        static_launches):
    from ft_launcher.hang.nccl_trace import trace_file
    from ft_launcher.rundir import FILES

    rows = {f.path: _path_pattern(f.path) for f in FILES}
    made = {str(p.relative_to(run_dir)) + ("/" if p.is_dir() else "")
            for run_dir, _, _ in static_launches for p in run_dir.rglob("*")}
    # The directories that hold a documented path (logs/, logs/cycle_<n>/, stacks/).
    holders = [_path_pattern(f"{parent}/", contents=False) for f in FILES
               for parent in Path(f.path).parents if str(parent) != "."]
    unknown = sorted(p for p in made if not any(rx.fullmatch(p)
                                                for rx in [*rows.values(), *holders]))
    assert not unknown, (f"not in docs/reference/run-directory.md: {unknown}; add a RunFile to "
                         f"FILES in ft_launcher/rundir.py, then run `{RENDER}`")
    # What no CPU run here makes, checked where the code names it: the file torch's @record
    # writes (the path the workers were given), NCCL's dump (the path the launcher moves it
    # to).
    given = {str(Path(e["TORCHELASTIC_ERROR_FILE"]).relative_to(run_dir))
             for run_dir, envs, _ in static_launches for e in envs}
    elsewhere = {"logs/cycle_<n>/rank_<r>_error.json": given,
                 "stacks/cycle_<n>_rank_<r>.nccl_trace": {str(trace_file(Path("stacks"), 3, 7))}}
    for path, rx in rows.items():
        paths = elsewhere.get(path, made)
        assert any(rx.fullmatch(p) for p in paths), f"documented, never made: {path}"
    assert all(rows["logs/cycle_<n>/rank_<r>_error.json"].fullmatch(p) for p in given), given


def test_summary_keys_are_documented(static_launches):
    from ft_launcher.rundir import FILES, SUMMARY_FILE

    row = next(f.content for f in FILES if f.path == SUMMARY_FILE)
    for run_dir, _, _ in static_launches:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        missing = [k for k in [*summary, *summary["next_action"]] if f"`{k}`" not in row]
        assert not missing, f"summary.json keys missing from its row in rundir.FILES: {missing}"


def test_a_token_per_rank_and_cycle(static_launches):
    """The docs say a token per rank and cycle: 2 ranks x 2 cycles, 4 tokens."""
    _, envs, _ = static_launches[1]
    tokens = {(e["FT_CYCLE"], e["RANK"]): e["FT_TOKEN"] for e in envs}
    assert len(tokens) == 4 and len(set(tokens.values())) == 4, tokens


def test_a_hang_on_one_node_dumps_the_stacks_of_every_rank(static_launches):
    run_dir, _, _ = static_launches[1]
    assert sorted(p.name for p in (run_dir / "stacks").iterdir()) == \
        ["cycle_0_rank_0.txt", "cycle_0_rank_1.txt"]


def test_the_run_directory_and_run_id_defaults(monkeypatch):
    from ft_launcher.cli import launch_config_from_args

    script = str(ROOT / "examples" / "train_ddp.py")
    cfg = launch_config_from_args(["--rdzv-id", "job7", script], {})
    assert cfg.run_id == "job7" and cfg.run_dir == Path("ft_runs") / "job7"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert launch_config_from_args([script], {}).run_id == "4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    stamped = launch_config_from_args([script], {}).run_id  # start time, random suffix
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", stamped), stamped
    assert launch_config_from_args([script], {}).run_id != stamped


def test_the_metrics_table_names_every_metric_the_launcher_serves():
    import prometheus_client  # the [metrics] extra, in [test]

    from ft_launcher.observe.metrics import MetricsExporter

    exporter = MetricsExporter(port=0)
    try:  # what a scrape returns, families without samples included
        text = prometheus_client.generate_latest(exporter.registry).decode()
    finally:
        exporter.close()
    names = set(re.findall(r"^# TYPE (ft_\w+) ", text, re.MULTILINE))
    page = (DOCS / "observability.md").read_text()
    table = page[page.index("| metric | meaning |"):page.index("## Status line")]
    documented = set(re.findall(r"`(ft_\w+)", table))
    assert names and names == documented, (sorted(names - documented),
                                           sorted(documented - names))


# The readers named in environment.md's second table, and where their code is.
READERS = {"`ft_launcher`": "ft_launcher", "the Lightning callback": "ft_agent/lightning.py",
           "`scripts/slurm/ft_sbatch.sh`": "scripts/slurm/ft_sbatch.sh"}


def _reads(where: Path, name: str) -> bool:
    """Whether the code under ``where`` names the variable as code does: a Python string
    literal, or a shell expansion (not a comment or a docstring that mentions it)."""
    files = [where] if where.is_file() else sorted(where.rglob("*.py"))
    pattern = re.compile(rf"""\$\{{?{name}\b""" if where.suffix == ".sh"
                         else rf"""["']{name}["']""")
    return any(pattern.search(f.read_text()) for f in files)


def test_every_variable_the_launcher_and_its_tools_read_is_read_there():
    page = (DOCS / "reference" / "environment.md").read_text()
    table = page[page.index("## What the launcher and its tools read"):]
    rows = [r for r in table.splitlines() if r.startswith("| `")]
    assert rows
    for row in rows:
        variables, readers = row.split(" | ")[:2]
        for reader in readers.lstrip("| ").split(", "):
            for name in re.findall(r"`(\w+)`", variables):
                assert _reads(ROOT / READERS[reader], name), f"{reader} does not read {name}"


# -- sentences that state a default, a scope or a behaviour ---------------------------------


@dataclass(frozen=True)
class Claim:
    """A sentence of the docs and what holds it true (CONTRIBUTING.md, "A claim in the
    docs"). ``text`` is found on ``page`` with its ``{}`` filled by ``figures()``, the code's
    own values, so a changed constant fails here until the page says the new one; ``tests``
    are the tests that fail when the behaviour changes."""

    page: str
    text: str
    figures: Callable[[], tuple[object, ...]] | None = None
    tests: tuple[str, ...] = ()


def _ft(name: str) -> object:
    from ft_launcher.config import FaultToleranceConfig

    return getattr(FaultToleranceConfig(), name)


def _click_default(flag: str) -> object:
    return next(p.default for p in render._command().params if flag in p.opts)


def _verdict_figures() -> tuple[str, str, str, int]:
    import statistics

    runs = json.loads((ROOT / "scripts/bench/verdict.json").read_text())["raw"]["verdict"]["ours"]
    excess = [r["excess_ms"] for r in runs]
    return (f"{min(excess):.1f}", f"{max(excess):.1f}", f"{statistics.median(excess):.1f}",
            len(runs))


def _exit_codes() -> tuple[int, ...]:
    from ft_launcher import policy

    return (policy.EXIT_SUCCESS, policy.EXIT_FAILURE, policy.EXIT_RESUME_ELSEWHERE,
            policy.EXIT_FAILED_VALIDATION, policy.EXIT_NO_PROGRESS)


def _verdict_crosses_nodes() -> tuple[()]:
    # The scope "on every node" holds while the other nodes answer a verdict (peer_verdict)
    # with their own ranks' stacks, and torch's backends share none.
    from ft_launcher.nodes.rendezvous import StaticRendezvous
    from ft_launcher.nodes.torch_rendezvous import DynamicRendezvous

    assert "peer_verdict" in EVENTS
    assert StaticRendezvous(0, 1, "127.0.0.1", None).verdict_channel(None) is None
    assert DynamicRendezvous.verdict_channel(None, None) is None
    return ()


def _first_cycle_only() -> tuple[()]:
    assert _faults().FaultPlan.cycles == range(0, 1), _faults().FaultPlan.cycles
    return ()


DEMO_RESUMES = ("tests/test_docs.py::"
                "test_getting_started_runnable_blocks_run_in_a_fresh_directory",)
HANG_E2E = ("tests/test_monitoring.py::"
            "test_sigstopped_rank_is_detected_dumped_killed_and_job_finishes")

CLAIMS = (
    # The scope of a token.
    Claim("README.md", "versioned JSON frames, a token per rank and cycle, 0700 directory",
          tests=("tests/test_docs.py::test_a_token_per_rank_and_cycle",
                 "tests/test_monitoring.py::"
                 "test_malformed_and_unauthenticated_messages_change_nothing")),
    Claim("docs/hang-detection.md", "a token per rank and cycle, so a hello can only claim the "
          "rank it was given to", tests=("tests/test_docs.py::test_a_token_per_rank_and_cycle",
                                         "tests/test_monitoring.py::"
                                         "test_malformed_and_unauthenticated_messages_change_"
                                         "nothing")),
    # Which ranks' stacks a hang dumps: said here only; the other pages link to it.
    Claim("docs/hang-detection.md", "The stacks of every rank still running, on every node: "
          "with several nodes (`--rdzv-backend c10d` or `etcd`) each node dumps its own ranks' "
          "stacks when the verdict reaches it (`peer_verdict`)",
          figures=_verdict_crosses_nodes,
          tests=("tests/test_docs.py::test_a_hang_on_one_node_dumps_the_stacks_of_every_rank",
                 HANG_E2E, "tests/multinode/test_hang_nodes.py::"
                 "test_a_stopped_rank_alone_is_named_and_every_ranks_stacks_are_written")),
    # What the demo resumes from, with the defaults.
    Claim("README.md", "training resumes from the newest snapshot every rank holds in memory "
          "(the default, rather than its last checkpoint on disk)", tests=DEMO_RESUMES),
    Claim("docs/getting-started.md", "training resumes from the newest [snapshot](snapshots.md) "
          "every rank holds in memory (the default, rather than its last checkpoint on disk)",
          tests=DEMO_RESUMES),
    Claim("examples/train_ddp.py", "After a restart every rank resumes from the newest "
          "snapshot every rank holds in memory, else from the checkpoint", tests=DEMO_RESUMES),
    Claim("docs/observability.md", "last checkpoint (`checkpoint_saved`, or the snapshot the "
          "next cycle restored, which counts as a checkpoint of its step) → the fault",
          tests=("tests/test_snapshots.py::"
                 "test_ledger_counts_work_lost_from_the_restored_snapshot",)),
    Claim("docs/README.md", "resume from the newest step every rank holds, not the last "
          "checkpoint", tests=("tests/test_snapshots.py::"
                               "test_pick_iteration_is_the_newest_every_rank_has", *DEMO_RESUMES)),
    Claim("docs/reference/environment.md", "unless `--ft-snapshot-every off` (the default is "
          "`{}`)", lambda: (_ft("snapshot_every"),)),
    # Defaults and figures.
    Claim("README.md", "The run directory (`--ft-run-dir`, default `./ft_runs/<run id>`)",
          tests=("tests/test_docs.py::test_the_run_directory_and_run_id_defaults",)),
    Claim("docs/reference/run-directory.md", "the run id is `--rdzv-id`, else `SLURM_JOB_ID`, "
          "else the start time and a random suffix",
          tests=("tests/test_docs.py::test_the_run_directory_and_run_id_defaults",)),
    Claim("README.md", "Exit codes: {} done, {} failed (requeue), {} re-run elsewhere, {} "
          "validation failed, {} no progress, 128+signal.", _exit_codes),
    Claim("docs/hang-detection.md", "`--ft-rank-termination-signal` (default {}) to the hung "
          "rank", lambda: (_ft("rank_termination_signal").name,)),
    Claim("docs/hang-detection.md", "| `--ft-rank-termination-signal` ({}) |",
          lambda: (_ft("rank_termination_signal").name,)),
    Claim("docs/hang-detection.md", "`--workers-exit-timeout` seconds later (default {:g}; 0 "
          "waits forever)", lambda: (_click_default("--workers-exit-timeout"),)),
    Claim("docs/hang-detection.md", "{:g} s when any heartbeat or section timeout is set and "
          "this one is not given", lambda: (_agent_config().DEFAULT_INITIAL_TIMEOUT_S,)),
    Claim("docs/hang-detection.md", "| `--ft-safety-factor` ({}) |",
          lambda: (_ft("safety_factor"),)),
    Claim("docs/hang-detection.md", "| `--ft-min-learned-timeout` ({:g}) |",
          lambda: (_ft("min_learned_timeout"),)),
    Claim("docs/hang-detection.md", "is never below `--ft-min-learned-timeout` (default {:g} s",
          lambda: (_ft("min_learned_timeout"),)),
    Claim("docs/hang-detection.md", "| `--ft-log-level` ({}) |",
          lambda: (logging.getLevelName(_ft("log_level")),)),
    Claim("docs/hang-detection.md", "once {} heartbeat intervals were seen (in this run or a "
          "saved state), the monitor arms `max(safety_factor × longest interval, {:g} s)`",
          lambda: (_timeouts().AUTO_MIN_INTERVALS, _timeouts().AUTO_MIN_TIMEOUT_S)),
    Claim("docs/hang-detection.md", "more often than every {0:g} s (`HEARTBEAT_FOLD_S` in "
          "`ft_agent/protocol.py`) sends one heartbeat per {0:g} s",
          lambda: (_protocol().HEARTBEAT_FOLD_S,)),
    Claim("docs/hang-detection.md", "a wake-up more than {:g} s later than planned",
          lambda: (_liveness().STALL_THRESHOLD_S,)),
    Claim("docs/hang-detection.md", "verdicts wait {:g} s more while what the ranks sent "
          "meanwhile is read. Verdicts are only given once the socket's queue is empty (or "
          "after {:g} s of continuous flood)",
          lambda: (_liveness().STALL_SETTLE_S, _watch().MAX_JUDGE_DELAY_S)),
    Claim("docs/hang-detection.md", "it may sleep up to {:g} s after a read before it reads "
          "again", lambda: (_watch().MESSAGE_BATCH_S,)),
    Claim("docs/hang-detection.md", "the verdict came {} to {} ms after that call plus the "
          "timeout, median {} ms over {} runs", _verdict_figures),
    Claim("docs/getting-started.md", "`PYTHONUNBUFFERED=1` is set when unset",
          tests=("tests/test_worker_env.py::"
                 "test_user_settings_win_over_defaults_and_a_stale_fault_is_dropped",)),
    Claim("docs/observability.md", "Every `--ft-status-interval` seconds (default {:g}; 0 = off)",
          lambda: (_ft("status_interval"),)),
    Claim("docs/observability.md", "serves Prometheus metrics on `{}:PORT`",
          lambda: (_ft("metrics_addr"),)),
    Claim("docs/stragglers.md", "| `--ft-straggler-threshold` | `straggler_threshold` | {} |",
          lambda: (_ft("straggler_threshold"),)),
    Claim("docs/stragglers.md", "| `--ft-straggler-window` | `straggler_window` | {} |",
          lambda: (_ft("straggler_window"),)),
    Claim("docs/stragglers.md", "| `--ft-straggler-section` | `straggler_section` | `{}` |",
          lambda: (_ft("straggler_section"),)),
    Claim("docs/stragglers.md", "| `--ft-straggler-action` | `straggler_action` | `{}` |",
          lambda: (_ft("straggler_action"),)),
    Claim("docs/snapshots.md", "`2%` or `0.02`; `{:.0%}` by default",
          lambda: (_ft("snapshot_overhead"),)),
    Claim("docs/snapshots.md", "a state of up to {} KiB is checksummed and committed",
          lambda: (_snapshot().INLINE_BYTES // 1024,)),
    Claim("docs/warm-restart.md", "default `{}`, what a DDP script imports by its first step",
          lambda: (",".join(_ft("preload")),)),
    Claim("docs/simulated-faults.md", "`base_delay` (seconds, default {:g})",
          lambda: (_faults().FaultPlan.base_delay,)),
    Claim("docs/simulated-faults.md", "`cycles` (`N`, `A-B` or `all`; default the first cycle "
          "only", _first_cycle_only),
)


def _agent_config():
    from ft_agent import config

    return config


def _timeouts():
    from ft_launcher.hang import timeouts

    return timeouts


def _protocol():
    from ft_agent import protocol

    return protocol


def _liveness():
    from ft_launcher.hang import liveness

    return liveness


def _watch():
    from ft_launcher import watch

    return watch


def _snapshot():
    from ft_agent import snapshot

    return snapshot


def _faults():
    from ft_launcher import faults

    return faults


def _said(claim: Claim) -> str:
    figures = claim.figures() if claim.figures else ()
    return " ".join(claim.text.format(*figures).split())


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"{c.page}: {c.text[:40]}")
def test_a_claim_says_what_the_code_does(claim: Claim):
    page = " ".join((ROOT / claim.page).read_text().split())
    said = _said(claim)
    assert said in page, (f"{claim.page} no longer says {said!r}: say the code's figure, or "
                          "change the claim in tests/test_docs.py with the sentence")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def test_every_claim_is_held_by_a_figure_or_a_test():
    for claim in CLAIMS:
        assert claim.figures or claim.tests, claim
        for cited in claim.tests:
            path, _, name = cited.partition("::")
            assert name in _test_names(ROOT / path), f"{claim.page}: no test {cited}"


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
            # ... and that, with the defaults, every rank resumes from its newest snapshot
            restored = [json.loads(line) for p in where.glob("ft_runs/*/events.jsonl")
                        for line in p.read_text().splitlines()
                        if '"snapshot_restored"' in line]
            assert sorted(e["rank"] for e in restored if e["cycle"] == 1) == [0, 1], restored
