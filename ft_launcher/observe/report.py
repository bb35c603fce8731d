"""``ft_report RUN_DIR``: heartbeat and section intervals, timeouts, each cycle's faults,
the goodput ledger (where the time went), and with ``--html FILE`` a timeline page.

Reads only the run directory (events.jsonl, ft_state.json, summary.json), so it works on a
finished job, a running one, or a copy taken from a cluster. Attempts (a requeued job that
reused its run directory) are kept apart: every row names its attempt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ft_launcher import faults
from ft_launcher.extras import MissingExtra
from ft_launcher.hang.timeouts import SECTION_PREFIX, SECTIONS_KEY, TIMEOUT_KEYS
from ft_launcher.observe.ledger import ledger_of, split_attempts
from ft_launcher.rundir import read_events
from ft_launcher.stragglers.straggler import speed_table


def _timeouts_in_force(events: list[dict[str, Any]]) -> dict[str, Any]:
    current: dict[str, Any] = {}
    for e in events:
        if e["event"] in ("launcher_started", "timeouts_updated") and "timeouts" in e:
            current = e["timeouts"]
    return current


def _timeout_of(kind: str, timeouts: dict[str, Any]) -> Any:
    if kind.startswith(SECTION_PREFIX):
        return (timeouts.get(SECTIONS_KEY) or {}).get(kind[len(SECTION_PREFIX):])
    key = TIMEOUT_KEYS.get(kind)
    return timeouts.get(key) if key else None


def interval_rows(run_dir: Path, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cycle, rank and interval kind, with the timeouts in force and calculated."""
    in_force = _timeouts_in_force(events)
    try:
        state = json.loads((run_dir / "ft_state.json").read_text())
        calculated = state.get("calculated", {})
    except (OSError, ValueError):
        calculated = {}
    rows = []
    for e in events:
        if e["event"] != "interval_stats":
            continue
        rows.append({
            "cycle": e["cycle"], "rank": e["rank"], "kind": e["kind"], "count": e["count"],
            "min": e["min"], "p50": e["p50"], "p99": e["p99"], "max": e["max"],
            "timeout_in_force": _timeout_of(e["kind"], in_force),
            "timeout_calculated": _timeout_of(e["kind"], calculated),
        })
    return rows


def cycle_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cycle: its faults, how fast the fault was seen, how fast the job restarted."""
    cycles: dict[int, dict[str, Any]] = {}
    for e in events:
        c = cycles.setdefault(e["cycle"], {"cycle": e["cycle"], "faults": [], "events": []})
        c["events"].append(e)
    rows = []
    for n in sorted(cycles):
        evs = cycles[n]["events"]
        injected = next((e for e in evs if e["event"] == "fault_injected"), None)
        hang = next((e for e in evs if e["event"] == "hang_detected"), None)
        peer = next((e for e in evs if e["event"] == "peer_verdict"), None)
        failed = next((e for e in evs if e["event"] == "worker_exited"
                       and not e.get("stopped_by_launcher") and e.get("exit_code") != 0), None)
        detected = hang or failed
        faults = []
        if injected:
            faults.append(f"injected {injected['fault_type']} rank {injected['rank']}")
        if hang:
            faults.append(f"hang rank {hang['rank']}{_on(hang.get('host'))} "
                          f"({hang['timeout_kind']}, {hang['silence_s']} s silent, "
                          f"blame {hang.get('blame', '?')})")
        if peer:
            faults.append(f"hang rank {peer.get('rank')} on node {peer.get('node')}"
                          f"{_on(peer.get('host'))} ({peer.get('blame')}): named by that "
                          f"node; this node's stacks dumped, none of its ranks killed")
        if failed:
            how = failed.get("signal") or f"exit {failed.get('exit_code')}"
            faults.append(f"rank {failed['rank']} died ({how})")
        faults += [not_fired_line(e) for e in evs if e["event"] == "fault_not_fired"]
        decision = next((e for e in evs if e["event"] == "decision"), None)
        nxt = cycles.get(n + 1, {}).get("events", [])
        started = next((e for e in nxt if e["event"] == "workers_started"), None)
        connected = [e for e in nxt if e["event"] == "rank_connected"]
        rows.append({
            "cycle": n,
            "faults": faults,
            "detection_s": round(detected["ts"] - injected["ts"], 3)
            if detected and injected else None,
            "restart_s": round(started["ts"] - detected["ts"], 3)
            if started and detected else None,
            "reconnect_s": round(max(e["ts"] for e in connected) - detected["ts"], 3)
            if connected and detected else None,
            "decision": decision.get("reason") if decision else None,
        })
    return rows


def _on(host: Any) -> str:
    return f" on {host}" if host else ""


def not_fired_line(e: dict[str, Any]) -> str:
    """A simulated fault that never fired, as ft_report's cycle line says it."""
    return faults.not_fired_text(e).replace(" never fired", " NOT FIRED", 1)


def build_report(run_dir: Path, events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything ft_report shows, JSON-ready. Interval and cycle rows carry their attempt."""
    if events is None:
        events = read_events(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    intervals, cycles = [], []
    for attempt, part in split_attempts(events):
        intervals += [{"attempt": attempt, **r} for r in interval_rows(run_dir, part)]
        cycles += [{"attempt": attempt, **r} for r in cycle_rows(part)]
    section = next((e["straggler_section"] for e in events
                    if e.get("event") == "launcher_started"
                    and isinstance(e.get("straggler_section"), str)), "compute")
    return {"run_dir": str(run_dir), "intervals": intervals, "cycles": cycles,
            "ledger": ledger_of(events).summary(), "summary": summary,
            "speeds": {"section": section, "rows": speed_table(events, section)},
            "preloads": preload_rows(events), "snapshot_frequency": frequency_rows(events)}


FREQUENCY_COLUMNS = [("cycle", "cycle"), ("every", "every"), ("from", "start"),
                     ("why", "reason"), ("rank", "rank"), ("blocking_s", "blocking_s"),
                     ("commit_s", "commit_s"), ("commit counted", "commit_counted"),
                     ("step_s", "step_s"), ("overhead", "overhead")]


def frequency_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The default snapshot frequency the ranks agreed on, and each change of it."""
    return [{key: e.get(key) for _, key in FREQUENCY_COLUMNS}
            for e in events if e.get("event") == "snapshot_frequency"]


def frequency_lines(rows: list[dict[str, Any]] | None) -> list[str]:
    """The report's snapshot frequency table: nothing when there was none."""
    if not rows:
        return []
    return ["", "Snapshot frequency (every N steps from an iteration; why: the rank whose "
                "snapshots cost the most for its step time)"] + _table(
        [name for name, _ in FREQUENCY_COLUMNS],
        [[_pct(r[key]) if key == "overhead" else _fmt(r[key]) for _, key in FREQUENCY_COLUMNS]
         for r in rows], "  ")


def preload_rows(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the zygotes learned (packages, modules, import seconds) and refused, with why.
    A requeued job's import of what an earlier one learned (``from_state``) adds packages
    only: its modules were counted once already."""
    learned = [e for e in events if e.get("event") == "preload_learned"]
    packages = sorted({m for e in learned for m in e.get("modules") or [] if isinstance(m, str)})
    new = [e for e in learned if not e.get("from_state")]
    return {"packages": packages,
            "modules": sum(e.get("count") or 0 for e in new),
            "import_s": round(sum(e.get("import_s") or 0.0 for e in new), 3),
            "cpu_s": round(sum(e.get("cpu_s") or 0.0 for e in new), 3),
            "refused": {str(e.get("module")): str(e.get("reason"))
                        for e in events if e.get("event") == "preload_refused"}}


def preload_lines(preloads: dict[str, Any] | None) -> list[str]:
    """The report's preload lines: nothing when nothing was learned or refused."""
    if not preloads or not (preloads["packages"] or preloads["refused"]):
        return []
    lines = [""]
    if preloads["packages"]:
        lines.append(f"Preloads learned: {', '.join(preloads['packages'])} "
                     f"({preloads['modules']} modules, imported in {preloads['import_s']:.3f} s, "
                     f"{preloads['cpu_s']:.3f} s of CPU)")
    lines += [f"Preload refused: {name} ({reason})" for name, reason in preloads["refused"].items()]
    return lines


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _table(head: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    table = [head] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return [indent + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
            for row in table]


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


LEDGER_COLUMNS = [
    ("cycle", "cycle"), ("cause", "cause"), ("fault->detected", "detection_s"),
    ("teardown", "teardown_s"), ("rendezvous", "rendezvous_s"),
    ("spawn->1st step", "spawn_to_first_step_s"), ("productive", "productive_s"),
    ("work lost", "work_lost_s"), ("steps lost", "work_lost_steps"),
    ("ckpt step", "checkpoint_step"), ("resumed at", "next_cycle_first_step"),
]


def render_ledger(attempt: dict[str, Any], progress_reported: bool) -> list[str]:
    """The goodput ledger of one attempt as text lines."""
    rows = []
    for c in attempt["cycles"]:
        row = [_fmt(c[key]) for _, key in LEDGER_COLUMNS]
        if c["no_progress"]:
            row[1] += " - NO PROGRESS"
        rows.append(row)
    lines = _table([name for name, _ in LEDGER_COLUMNS], rows, "  ")
    lost = ", ".join(f"{k} {v:.3f}" for k, v in attempt["lost_s"].items() if v)
    by_cause = ", ".join(f"{k} {v:.3f}" for k, v in attempt["lost_by_cause_s"].items())
    lines += [
        f"  wall {attempt['wall_s']:.3f} s, productive {attempt['productive_s']:.3f} s, "
        f"goodput {_pct(attempt['goodput'])}",
        f"  lost by phase (s): {lost or 'nothing'}",
        f"  lost by cause (s): {by_cause or 'nothing'}",
    ]
    if not progress_reported:
        lines.append("  (the training reported no steps or checkpoints: work lost to a fault "
                     "is unknown and counted as productive; goodput is an upper bound)")
    return lines


def render_text(report: dict[str, Any]) -> str:
    ledger = report.get("ledger") or {"attempts": [], "progress_reported": False}
    several = len(ledger["attempts"]) > 1
    lines = [f"Run {report['run_dir']}"]
    attempts = sorted({r.get("attempt", 1) for r in report["intervals"] + report["cycles"]}
                      | {a["attempt"] for a in ledger["attempts"]}) or [1]
    for n in attempts:
        if several:
            lines += ["", f"=== Attempt {n} ==="]
        lines += ["", "Intervals (seconds)"]
        lines += _table(
            ["cycle", "rank", "kind", "count", "min", "p50", "p99", "max", "timeout",
             "calculated"],
            [[_fmt(r[k]) for k in ("cycle", "rank", "kind", "count", "min", "p50", "p99", "max",
                                   "timeout_in_force", "timeout_calculated")]
             for r in report["intervals"] if r.get("attempt", 1) == n])
        lines += ["", "Cycles"]
        for c in report["cycles"]:
            if c.get("attempt", 1) != n:
                continue
            lines.append(
                f"  cycle {c['cycle']}: {'; '.join(c['faults']) or 'no fault'}"
                f" | detection {_fmt(c['detection_s'])} s | restart {_fmt(c['restart_s'])} s"
                f" | all ranks back {_fmt(c['reconnect_s'])} s | {c['decision'] or ''}"
            )
        for a in ledger["attempts"]:
            if a["attempt"] == n:
                lines += ["", "Goodput ledger (seconds)"]
                lines += render_ledger(a, ledger["progress_reported"])
    if several:
        lines += ["", f"All {len(ledger['attempts'])} attempts: wall {ledger['wall_s']:.3f} s, "
                      f"productive {ledger['productive_s']:.3f} s, "
                      f"goodput {_pct(ledger['goodput'])}"]
    speeds = report.get("speeds") or {"rows": []}
    if speeds["rows"]:
        lines += ["", f"Relative speed (median time in section {speeds['section']!r}; "
                      "score = time / the other ranks' median; > threshold: straggler)"]
        lines += _table(["cycle", "rank", "host", "steps", "median_s", "score", "speed",
                         "straggler"],
                        [[_fmt(r.get(k)) for k in ("cycle", "rank", "host", "count",
                                                     "median_s", "score", "speed")]
                         + ["yes" if r["straggler"] else ""] for r in speeds["rows"]])
    lines += preload_lines(report.get("preloads"))
    lines += frequency_lines(report.get("snapshot_frequency"))
    s = report["summary"]
    if s:
        lines += ["", f"Exit {s['exit_code']}: {s['reason']} ({s['restarts']} restarts); "
                      f"next: {'requeue' if s['next_action']['requeue'] else 'stop'}"
                      f"{' excluding ' + ','.join(s['next_action']['exclude_nodes']) if s['next_action']['exclude_nodes'] else ''}"]  # noqa: E501
    lines += resume_lines(ledger)
    return "\n".join(lines)


def resume_lines(ledger: dict[str, Any]) -> list[str]:
    """One closing line per restart: where the next cycle resumed, or that it started over."""
    lines = []
    for a in ledger["attempts"]:
        for c in a["cycles"][:-1]:
            first = c.get("next_cycle_first_step")
            if first is None:
                continue
            ckpt = c.get("checkpoint_step")
            source = "snapshot" if c.get("checkpoint_source") == "snapshot" else "checkpoint"
            how = f"resumed at step {first} from its {source} of step {ckpt}" \
                if ckpt is not None else f"started over at step {first} (no checkpoint)"
            lines.append(f"Cycle {c['cycle'] + 1} {how} after {c['cause']}.")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a self-contained timeline page of the run to this file "
                   "(needs the extra: pip install 'ft-launcher[report]').")
def cli(run_dir: Path, as_json: bool, html_path: Path | None) -> None:
    """Report heartbeat/section intervals, timeouts, faults and the goodput ledger of an
    ft_launcher run."""
    if not (run_dir / "events.jsonl").is_file():
        raise click.ClickException(f"{run_dir}: no events.jsonl (not an ft_launcher run dir)")
    events = read_events(run_dir)
    report = build_report(run_dir, events)
    if html_path is not None:
        from ft_launcher.observe import timeline

        try:
            timeline.write_html(html_path, events, report)
        except MissingExtra as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:
            raise click.ClickException(f"--html {html_path}: {exc.strerror or exc}") from None
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        click.echo(render_text(report))


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
