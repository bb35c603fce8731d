"""``ft_report --html FILE``: one self-contained page showing a run on a timeline.

A lane per rank (plus one for the launcher) carries a mark per event — spawn, connection,
first step, checkpoints, sections when recorded, faults, verdicts, kills, exits — each
showing its event's fields on hover; every cycle's phases from the goodput ledger are shaded
behind the lanes (productive green, lost time in warm colours) and drawn as bars in a
``phases`` lane; the ledger table sits beside the plot. plotly.js is embedded, so the page
needs no network when viewed. plotly is an optional extra: ``ft-launcher[report]``.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ft_launcher.extras import import_extra
from ft_launcher.observe.ledger import PHASES, well_formed

# Events too frequent or too internal to draw as marks.
SKIPPED = {"interval_stats", "timeouts_updated"}
MAX_MARKS_PER_KIND = 5000  # bounds the page for runs with very many events

PHASE_COLOURS = {
    "rendezvous": "#b0b7c3", "spawn": "#f2c14e", "productive": "#59a14f",
    "work_lost": "#e15759", "detection": "#f28e2b", "teardown": "#b07aa1", "other": "#d3d3d3",
}
SYMBOLS = {
    "workers_started": "triangle-right", "rank_connected": "circle-open",
    "first_step": "star", "training_started": "star-open", "checkpoint_saved": "square",
    "last_progress": "line-ns-open", "fault_injected": "x", "hang_detected": "hourglass",
    "rank_killed": "x-thin-open", "worker_exited": "square-x-open", "restart": "triangle-up",
    "decision": "diamond", "stacks_dumped": "bowtie", "diagnosis": "cross",
    "launcher_started": "triangle-right-open", "launcher_exited": "triangle-left-open",
}
LAUNCHER_LANE = "launcher"
PHASE_LANE = "phases"


def _esc(text: object) -> str:
    """Escape for plotly's HTML-like labels (it renders few entities: leave quotes)."""
    return html.escape(str(text), quote=False)


def _plotly() -> Any:
    go, subplots = import_extra(("plotly.graph_objects", "plotly.subplots"),
                                "ft_report --html", "plotly", "report")
    return go, subplots.make_subplots


def _when(record: dict[str, Any]) -> float | None:
    """When the event happened: a fault's or a last report's own time where it has one."""
    for key in ("at", "ts"):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value == value and abs(value) != float("inf"):
            return float(value)
    return None


def _lanes_of(record: dict[str, Any]) -> list[str]:
    rank = record.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        return [f"rank {rank}"]
    if record.get("event") == "workers_started" and isinstance(record.get("ranks"), list):
        return [f"rank {r}" for r in record["ranks"] if isinstance(r, int)]
    return [LAUNCHER_LANE]


def _hover(record: dict[str, Any], t0: float) -> str:
    fields = {k: v for k, v in record.items() if k not in ("event",)}
    text = json.dumps(fields, default=str, sort_keys=True)
    if len(text) > 600:
        text = text[:600] + "…"
    body = _esc(text).replace(", ", ",<br>")  # plotly knows few entities
    return (f"<b>{_esc(str(record.get('event')))}</b> at "
            f"{_when(record) - t0:.3f} s<br>{body}")


def build_figure(events: list[dict[str, Any]], report: dict[str, Any]) -> Any:
    """The plotly figure of a run: lanes with marks, shaded phases, the ledger beside."""
    go, make_subplots = _plotly()
    timed = [e for e in events if well_formed(e) and _when(e) is not None]
    t0 = min((_when(e) for e in timed), default=0.0)
    ranks = sorted({lane for e in timed for lane in _lanes_of(e) if lane != LAUNCHER_LANE},
                   key=lambda lane: int(lane.split()[1]))
    lanes = [PHASE_LANE, LAUNCHER_LANE, *ranks]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.64, 0.36], horizontal_spacing=0.03,
                        specs=[[{"type": "xy"}, {"type": "table"}]])

    ledger = report.get("ledger") or {"attempts": []}
    _add_phases(go, fig, ledger, t0)

    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in timed:
        kind = str(e.get("event"))
        if kind not in SKIPPED:
            by_kind.setdefault(kind, []).append(e)
    for kind, records in by_kind.items():
        xs, ys, texts = [], [], []
        for e in records[:MAX_MARKS_PER_KIND]:
            for lane in _lanes_of(e):
                xs.append(_when(e) - t0)
                ys.append(lane)
                texts.append(_hover(e, t0))
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="markers", name=kind, hovertext=texts, hoverinfo="text",
            marker={"symbol": SYMBOLS.get(kind, "circle"), "size": 11,
                    "line": {"width": 1.5}}), row=1, col=1)

    for a in ledger["attempts"]:
        for c in a["cycles"]:
            x = c["start_ts"] - t0
            fig.add_shape(type="line", xref="x", yref="y domain", x0=x, x1=x, y0=0, y1=1,
                          line={"width": 1, "dash": "dot", "color": "#555"})
            fig.add_annotation(x=x, y=1.0, yref="paper", xref="x", showarrow=False,
                               xanchor="left", yanchor="bottom", font={"size": 11},
                               text=f"cycle {c['cycle']}"
                               + (f" (attempt {a['attempt']})" if len(ledger["attempts"]) > 1
                                  else ""))
    table = _ledger_table(go, ledger)
    fig.add_trace(table, row=1, col=2)
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), type="category",
                     row=1, col=1)
    fig.update_xaxes(title_text="seconds since the launcher started", row=1, col=1)
    goodput = ledger.get("goodput")
    title = f"ft_launcher run {Path(str(report.get('run_dir', ''))).name}"
    if goodput is not None:
        title += f" — goodput {100 * goodput:.1f}%"
    # Tall enough for the lanes and, up to a point, the whole ledger (beyond, it scrolls).
    plot_h = max(46 * len(lanes) + 120, min(23 * len(table.cells.values[0]) + 60, 900))
    fig.update_layout(title={"text": _esc(title)}, height=plot_h + 240,
                      width=1500, template="plotly_white", hovermode="closest",
                      legend={"orientation": "h", "yanchor": "top", "y": -0.12, "x": 0},
                      margin={"t": 80, "b": 40})
    return fig


def _add_phases(go: Any, fig: Any, ledger: dict[str, Any], t0: float) -> None:
    """Each cycle's phases: shaded behind the lanes and as hoverable bars in their lane."""
    bars: dict[str, dict[str, list[Any]]] = {p: {"x": [], "base": [], "text": []}
                                              for p in PHASES}
    for a in ledger["attempts"]:
        for c in a["cycles"]:
            start = c["start_ts"] - t0
            for phase in PHASES:
                secs = c["phases_s"].get(phase, 0.0)
                if secs <= 0:
                    continue
                fig.add_shape(type="rect", xref="x", yref="y domain", x0=start,
                              x1=start + secs, y0=0, y1=1, fillcolor=PHASE_COLOURS[phase],
                              opacity=0.18, layer="below", line_width=0)
                bars[phase]["x"].append(secs)
                bars[phase]["base"].append(start)
                bars[phase]["text"].append(
                    f"<b>{phase}</b> {secs:.3f} s<br>cycle {c['cycle']}"
                    + (f"<br>cause: {_esc(str(c['cause']))}" if c["cause"] else "")
                    + ("<br><b>no progress</b>" if c["no_progress"] else ""))
                start += secs
    for phase, b in bars.items():
        if b["x"]:
            fig.add_trace(go.Bar(
                x=b["x"], base=b["base"], y=[PHASE_LANE] * len(b["x"]), orientation="h",
                name=f"{phase} time", marker={"color": PHASE_COLOURS[phase]},
                hovertext=b["text"], hoverinfo="text", width=0.6), row=1, col=1)
    fig.update_layout(barmode="overlay")


def _ledger_table(go: Any, ledger: dict[str, Any]) -> Any:
    rows: list[tuple[str, str]] = []
    several = len(ledger["attempts"]) > 1
    for a in ledger["attempts"]:
        prefix = f"attempt {a['attempt']} " if several else ""
        for c in a["cycles"]:
            label = f"{prefix}cycle {c['cycle']}"
            rows.append((f"<b>{label}</b>", _esc(c["cause"] or c["outcome"] or "")
                         + (" — <b>NO PROGRESS</b>" if c["no_progress"] else "")))
            for name, key in (("fault → detected", "detection_s"), ("teardown", "teardown_s"),
                              ("rendezvous", "rendezvous_s"),
                              ("spawn → first step", "spawn_to_first_step_s"),
                              ("productive", "productive_s"), ("work lost", "work_lost_s")):
                if c.get(key) is not None:
                    rows.append((f"  {name}", f"{c[key]:.3f} s"))
            if c.get("work_lost_steps") is not None:
                rows.append(("  steps lost", str(c["work_lost_steps"])))
            if c.get("next_cycle_first_step") is not None:
                rows.append(("  next cycle resumed at step", str(c["next_cycle_first_step"])))
        rows.append((f"<b>{prefix}goodput</b>", "-" if a["goodput"] is None
                     else f"{100 * a['goodput']:.1f}% ({a['productive_s']:.1f} of "
                          f"{a['wall_s']:.1f} s)"))
        for cause, secs in a["lost_by_cause_s"].items():
            rows.append((f"  lost: {_esc(cause)}", f"{secs:.3f} s"))
    return go.Table(
        columnwidth=[0.55, 0.45],
        header={"values": ["<b>goodput ledger</b>", ""], "align": "left"},
        cells={"values": [[r[0] for r in rows], [r[1] for r in rows]], "align": "left",
               "height": 22})


def write_html(path: Path, events: list[dict[str, Any]], report: dict[str, Any]) -> None:
    """Write the timeline page, with plotly.js embedded (no network at viewing time)."""
    fig = build_figure(events, report)
    Path(path).write_text(fig.to_html(include_plotlyjs=True, full_html=True,
                                      config={"displaylogo": False}), encoding="utf-8")
