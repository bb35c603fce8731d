"""ft_report: the goodput ledger as a table and in --json, attempts kept apart, --html."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_ledger import T0, Stream, killed_then_finished

from ft_launcher.observe.report import build_report
from ft_launcher.observe.timeline import build_figure

FT_REPORT = str(Path(sys.executable).parent / "ft_report")


def write_run(path: Path, *streams: Stream) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "events.jsonl", "w") as f:
        for s in streams:
            for r in s.records:
                f.write(json.dumps(r) + "\n")
    return path


def with_intervals(s: Stream) -> Stream:
    """Adds the interval_stats the launcher writes at the end of each cycle."""
    out = Stream()
    for r in s.records:
        if r["event"] == "decision":
            out.records.append({**r, "event": "interval_stats", "rank": 0, "kind": "heartbeat",
                                "count": 10 + r["cycle"], "min": 0.1, "p50": 0.1, "p99": 0.1,
                                "max": 0.1})
        out.records.append(r)
    return out


def no_progress_run() -> Stream:
    s = Stream()
    s.at(0, "launcher_started").at(0.1, "rendezvous_done").at(0.2, "workers_started", ranks=[0])
    s.at(5, "fault_injected", rank=0, fault_type="rank_killed", at=T0 + 5)
    s.at(5.1, "worker_exited", rank=0, exit_code=None, signal="SIGKILL")
    s.at(5.2, "decision", outcome="failed").restart(5.3)
    s.at(5.4, "rendezvous_done").at(5.5, "workers_started", ranks=[0])
    s.at(7, "first_step", rank=0, iteration=1).at(9, "checkpoint_saved", rank=0, iteration=10)
    s.at(10, "last_progress", rank=0, iteration=20, at=T0 + 10)
    s.at(10.5, "worker_exited", rank=0, exit_code=0)
    s.at(11, "launcher_exited", exit_code=0, reason="done")
    return s


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([FT_REPORT, *args], capture_output=True, text=True, timeout=60)


def test_ledger_table_and_json(tmp_path: Path):
    run = write_run(tmp_path / "run", killed_then_finished())
    text = report(str(run))
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "Goodput ledger (seconds)" in out and "=== Attempt" not in out
    row0 = next(line for line in out.splitlines() if line.strip().startswith("0  injected"))
    # cycle, cause, fault->detected, teardown, rendezvous, spawn, productive, work lost,
    # steps lost, checkpoint step, resumed at
    assert row0.split()[3:] == ["0.100", "0.400", "0.500", "2.000", "8.000", "1.500", "20",
                                "100", "101"]
    assert "goodput 60.4%" in out and "injected rank_killed 5.500" in out
    data = json.loads(report(str(run), "--json").stdout)
    att, = data["ledger"]["attempts"]
    assert att["cycles"][0]["work_lost_s"] == 1.5 and data["ledger"]["goodput"] == 0.604
    assert [c["attempt"] for c in data["cycles"]] == [1, 1]


def test_a_cycle_without_progress_is_marked(tmp_path: Path):
    run = write_run(tmp_path / "run", no_progress_run())
    out = report(str(run)).stdout
    row0 = next(line for line in out.splitlines() if line.strip().startswith("0  injected"))
    assert "NO PROGRESS" in row0
    row1 = next(line for line in out.splitlines() if line.strip().startswith("1  "))
    assert "NO PROGRESS" not in row1
    data = json.loads(report(str(run), "--json").stdout)
    assert [c["no_progress"] for c in data["ledger"]["attempts"][0]["cycles"]] == [True, False]


def test_attempts_in_one_run_dir_are_kept_apart(tmp_path: Path):
    run = write_run(tmp_path / "run", with_intervals(killed_then_finished()),
                    with_intervals(killed_then_finished(attempt=2, offset=100)))
    out = report(str(run)).stdout
    assert out.count("=== Attempt 1 ===") == 1 and out.count("=== Attempt 2 ===") == 1
    first, second = out.split("=== Attempt 2 ===")
    for part in (first, second):  # each attempt has its own two cycles, not four
        assert part.count("  cycle 0:") == 1 and part.count("  cycle 1:") == 1
        assert part.count("Goodput ledger") == 1
    assert "All 2 attempts: wall 50.000 s" in second
    data = json.loads(report(str(run), "--json").stdout)
    assert [(c["attempt"], c["cycle"]) for c in data["cycles"]] == [(1, 0), (1, 1), (2, 0),
                                                                     (2, 1)]
    assert [(r["attempt"], r["cycle"]) for r in data["intervals"]] == [(1, 0), (1, 1), (2, 0),
                                                                       (2, 1)]
    # The restart of attempt 2 is paired with attempt 2's detection, not attempt 1's.
    assert data["cycles"][2]["restart_s"] == data["cycles"][0]["restart_s"]


def test_html_timeline_is_self_contained(tmp_path: Path):
    run = write_run(tmp_path / "run", killed_then_finished())
    page = tmp_path / "timeline.html"
    res = report(str(run), "--html", str(page))
    assert res.returncode == 0, res.stderr
    assert "Goodput ledger" in res.stdout  # the text report still comes
    doc = page.read_text()
    # plotly.js is embedded: no script or stylesheet is fetched when the page is viewed.
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=\"?https?:", doc)
    assert "Plotly.newPlot" in doc and len(doc) > 1_000_000
    for name in ("fault_injected", "worker_exited", "first_step", "checkpoint_saved",
                 "productive time", "work_lost time", "goodput ledger"):
        assert f'"{name}"' in doc or name in doc, name
    # Each mark carries its event's fields for the hover box.
    fig = build_figure(killed_then_finished().records, build_report(run))
    hover = {t.name: list(t.hovertext) for t in fig.data if t.type == "scatter"}
    assert hover["worker_exited"][0].startswith("<b>worker_exited</b> at 12.600 s<br>")
    assert '"signal": "SIGKILL"' in hover["worker_exited"][0]
    assert '"iteration": 100' in hover["checkpoint_saved"][1]


def test_html_without_plotly_says_which_extra_to_install(tmp_path: Path):
    run = write_run(tmp_path / "run", killed_then_finished())
    code = ("import sys; sys.modules['plotly'] = None; "
            "from ft_launcher.observe.report import main; main()")
    res = subprocess.run([sys.executable, "-c", code, str(run), "--html",
                          str(tmp_path / "t.html")], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        "Error: ft_report --html needs plotly: pip install 'ft-launcher[report]'"]
    assert not (tmp_path / "t.html").exists()


def test_html_to_an_unwritable_path_is_a_clear_error(tmp_path: Path):
    run = write_run(tmp_path / "run", killed_then_finished())
    res = report(str(run), "--html", str(tmp_path / "missing" / "t.html"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "--html" in res.stderr and "No such file" in res.stderr


@pytest.mark.parametrize("junk", ["{not json", '{"ts": "x", "event": 1, "cycle": null}',
                                  '[1, 2]', '{"ts": 1e999, "event": "restart", "cycle": 0}'])
def test_malformed_lines_do_not_break_the_report(tmp_path: Path, junk: str):
    run = write_run(tmp_path / "run", killed_then_finished())
    with open(run / "events.jsonl", "a") as f:
        f.write(junk + "\n")
    res = report(str(run), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ledger"]["attempts"][0]["restarts"] == 1


def test_each_node_says_which_rank_on_which_node_was_named_and_why(tmp_path: Path):
    judged, answered = Stream(), Stream()
    judged.at(0, "launcher_started").at(0.1, "rendezvous_done").at(0.2, "workers_started",
                                                                    ranks=[0, 1])
    judged.at(6, "hang_detected", rank=1, timeout_kind="heartbeat", silence_s=4.1,
              blame="stopped", host="node-a", detected_at=T0 + 6)
    judged.at(6.3, "decision", outcome="hung")
    answered.at(0, "launcher_started").at(0.1, "rendezvous_done").at(0.2, "workers_started",
                                                                     ranks=[2, 3])
    answered.at(6.1, "peer_verdict", rank=1, node="node-a-77-ab12", host="node-a",
                group_rank=0, blame="stopped", timeout_kind="heartbeat", silence_s=4.1)
    answered.at(6.2, "decision", outcome="peer_changed")
    a = report(str(write_run(tmp_path / "a", judged))).stdout
    b = report(str(write_run(tmp_path / "b", answered))).stdout
    assert "hang rank 1 on node-a (heartbeat, 4.1 s silent, blame stopped)" in a
    assert ("hang rank 1 on node node-a-77-ab12 on node-a (stopped): named by that node; "
            "this node's stacks dumped, none of its ranks killed") in b
