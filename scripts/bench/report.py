"""Summaries, per-pair ratios, targets, and the Markdown table of a benchmark run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

WARM = "ours-warm"  # ours with warm restart; compared with ours (cold) and the others
SNAP = "ours-snap"  # ours with in-memory snapshots; compared with ours and the others
VARIANTS = (WARM, SNAP)  # each has its own table of ratios, out of ours' columns
EAGER, COMPILED = "ours-eager", "ours-compiled"  # the compiled measure's pair
LAUNCHER_TITLES = {"ours": "ours", WARM: "ours-warm", "ours-cold": "ours-cold",
                   SNAP: "ours-snap", "torchrun": "torchrun", "nvrx": "NVRx 0.4.1",
                   EAGER: "eager", COMPILED: "torch.compile"}
# The compiled restart's targets: SIGKILL -> every rank's next step, median of the runs.
COMPILED_TARGETS = {"early_s": ("in the job's first seconds", 0.8),
                    "late_s": ("after a minute of training", 0.4)}
# Which ratios are taken: base launcher -> the key its ratios go under in a summary row.
RATIO_KEYS = {"ours": "ratio_vs_ours", WARM: "ratio_vs_ours_warm", SNAP: "ratio_vs_ours_snap"}
# The snapshot goodput target: every run of ours-snap at least this.
SNAP_GOODPUT = 0.95


@dataclass(frozen=True)
class Metric:
    """One row of the table: which figure of which measure, and which way is better."""

    measure: str
    key: str
    label: str
    unit: str
    better: str = "lower"  # or "higher"
    ratio: bool = True  # False where a ratio means nothing (a value near zero)
    digits: int = 2


METRICS = [
    Metric("heartbeat", "p50_us", "send_heartbeat() p50", "µs", digits=1),
    Metric("heartbeat", "p99_us", "send_heartbeat() p99", "µs", digits=1),
    Metric("heartbeat", "fold_p50_us", "send_heartbeat() p50, back to back (ours: folded)",
           "µs", digits=2),
    Metric("heartbeat", "sec_p50_us", "section open+close p50", "µs", digits=1),
    Metric("heartbeat", "sec_p99_us", "section open+close p99", "µs", digits=1),
    Metric("hang", "excess_ms", "hang verdict − SIGSTOP − 2 s timeout", "ms", ratio=False,
           digits=0),
    Metric("hang", "lag_ms", "hang verdict − last heartbeat − 2 s timeout (launcher's record)",
           "ms", ratio=False, digits=1),
    Metric("hang", "detect_s", "SIGSTOP → hang verdict", "s"),
    Metric("verdict", "excess_ms", "hang verdict − (last send_heartbeat() call + 2 s timeout),"
           " SIGSTOP right after the call", "ms", ratio=False, digits=1),
    Metric("verdict", "stop_after_return_ms", "the call's return → SIGSTOP (the driver's delay)",
           "ms", ratio=False, digits=2),
    Metric("crash", "recovery_s", "SIGKILL → first step of every rank, next cycle", "s"),
    Metric("crash", "respawn_s", "of which SIGKILL → every new worker running", "s"),
    Metric("startup", "startup_s", "launcher start → first step of every rank", "s"),
    Metric("startup", "spawn_s", "of which launcher start → first worker running", "s"),
    Metric("footprint", "cpu_pct", "launcher-side CPU, 8 ranks heartbeating at 10 Hz",
           "% of a core"),
    Metric("footprint", "pss_mb", "launcher-side PSS, same", "MB", digits=0),
    Metric("footprint", "rss_mb", "launcher-side RSS, same", "MB", digits=0),
    Metric("training", "cpu_pct", "launcher-side CPU, 2 ranks training, a heartbeat a step",
           "% of a core"),
    Metric("training", "sections_cpu_pct", "same, each step also in a section", "% of a core"),
    Metric("goodput", "goodput", "goodput: fault-free wall ÷ wall with the faults", "",
           better="higher"),
    Metric("goodput", "goodput_pair", "goodput: the pair's fastest fault-free wall ÷ wall with "
           "the faults (charges per-step costs such as snapshots)", "", better="higher"),
    Metric("goodput", "faulted_wall_s", "wall time with the faults", "s"),
    Metric("goodput", "clean_wall_s", "wall time fault-free", "s"),
    Metric("goodput", "redone_kill", "steps redone after the kill (step reached − step "
           "resumed from)", "steps", ratio=False, digits=0),
    Metric("goodput", "redone_hang", "steps redone after the hang, same", "steps",
           ratio=False, digits=0),
    Metric("goodput", "redone_node", "steps redone after the lost node, same", "steps",
           ratio=False, digits=0),
    Metric("compiled", "early_s", "SIGKILL in the job's first seconds → first step of every "
           "rank, next cycle", "s"),
    Metric("compiled", "late_s", "SIGKILL after a minute of training → same", "s"),
    Metric("compiled", "first_step_s", "launcher start → first step of every rank", "s"),
]


def _values(results: list[dict[str, Any]], key: str) -> list[float | None]:
    return [r.get(key) for r in results]


def summarize(metric: Metric, raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """min / median / max per launcher and the per-pair ratios: ours against torchrun and
    NVRx, ours-warm against ours (cold), torchrun and NVRx."""
    out: dict[str, Any] = {"measure": metric.measure, "metric": metric.key,
                           "label": metric.label, "unit": metric.unit, "better": metric.better,
                           "summary": {}, "ratio_vs_ours": {}, "ratio_vs_ours_warm": {}}
    for launcher, results in raw.items():
        values = _values(results, metric.key)
        ok = [v for v in values if v is not None]
        notes = sorted({r["note"] for r in results if r.get(metric.key) is None and "note" in r})
        entry: dict[str, Any] = {"n": len(values), "n_ok": len(ok), "samples": values,
                                 "bounded": any(metric.key in (r.get("bounded") or [])
                                                for r in results)}
        if ok:
            entry.update(min=min(ok), median=statistics.median(ok), max=max(ok))
        if notes:
            entry["notes"] = notes
        out["summary"][launcher] = entry
    if not metric.ratio:
        return out
    for base, key in RATIO_KEYS.items():
        if base not in raw:
            continue
        out.setdefault(key, {})
        for launcher, results in raw.items():
            # ours' ratios leave the variants out: each has its own row of ratios.
            if launcher == base or launcher in VARIANTS:
                continue
            entry = _pair_ratios(metric, raw[base], results)
            if entry is not None:
                # the other's figure at its bound: the ratio is at least this (≥)
                entry["bounded"] = out["summary"][launcher]["bounded"]
                out[key][launcher] = entry
    return out


def _pair_ratios(metric: Metric, mine: list[dict[str, Any]], theirs: list[dict[str, Any]]
                 ) -> dict[str, Any] | None:
    """Ratios of runs of the same repeat, oriented so > 1 means ``mine`` is better."""
    ratios = []
    for a, b in zip(_values(mine, metric.key), _values(theirs, metric.key), strict=False):
        if a is None or b is None or a <= 0 or b <= 0:
            continue
        ratios.append(b / a if metric.better == "lower" else a / b)
    if not ratios:
        return None
    return {"n": len(ratios), "min": min(ratios), "median": statistics.median(ratios),
            "max": max(ratios), "samples": [round(r, 4) for r in ratios]}


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with the figure it is judged on and whether it is met."""
    by_key = {(r["measure"], r["metric"]): r for r in rows}
    out = []

    def ratio(measure: str, key: str, other: str, base: str = "ours") -> float | None:
        row = by_key.get((measure, key))
        r = row.get(RATIO_KEYS[base], {}).get(other) if row else None
        return r["median"] if r else None

    hb = ratio("heartbeat", "p50_us", "nvrx")
    if hb is not None:
        out.append({"target": "heartbeat cost at least 10× below NVRx's (p50)",
                    "value": round(hb, 1), "met": hb >= 10})
    for key, what in (("excess_ms", "signal"), ("lag_ms", "last heartbeat")):
        row = by_key.get(("hang", key))
        ours = row["summary"].get("ours") if row else None
        if ours and ours["n_ok"]:
            worst = max(abs(v) for v in ours["samples"] if v is not None)
            out.append({"target": f"hang verdict within 50 ms of the timeout, counted from "
                                  f"the {what} (worst run, ms)",
                        "value": worst, "met": worst <= 50 and ours["n_ok"] == ours["n"]})
    row = by_key.get(("verdict", "excess_ms"))
    ours = row["summary"].get("ours") if row else None
    if ours and ours["n_ok"]:
        worst = max(abs(v) for v in ours["samples"] if v is not None)
        out.append({"target": "hang verdict within 50 ms of the timeout, counted from the "
                              "last send_heartbeat() call (worst run, ms)",
                    "value": worst, "met": worst <= 50 and ours["n_ok"] == ours["n"]})
    for measure, key, what in (("crash", "recovery_s", "crash recovery"),
                               ("startup", "startup_s", "start-up"),
                               ("goodput", "goodput", "goodput")):
        for other in ("torchrun", "nvrx"):
            r = ratio(measure, key, other)
            if r is not None:
                out.append({"target": f"{what} ahead of {LAUNCHER_TITLES[other]} "
                                      f"(median per-pair ratio > 1)",
                            "value": round(r, 2), "met": r > 1})
    for measure, key, what in (("crash", "recovery_s", "crash recovery"),
                               ("goodput", "goodput", "goodput")):
        for other in ("ours", "torchrun", "nvrx"):
            r = ratio(measure, key, other, base=WARM)
            if r is not None:
                title = "ours (cold restart)" if other == "ours" else LAUNCHER_TITLES[other]
                out.append({"target": f"{what} with warm restart (ours-warm) ahead of "
                                      f"{title} (median per-pair ratio > 1)",
                            "value": round(r, 2), "met": r > 1})
    return out + snapshot_targets(by_key.get(("goodput", "goodput_pair"))
                                  or by_key.get(("goodput", "goodput"))) \
        + compiled_targets(by_key)


def compiled_targets(by_key: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """The compiled training's restarts against their bounds (median over the runs; a run
    without a figure fails), with the same script eager beside it."""
    out = []
    for key, (when, bound) in COMPILED_TARGETS.items():
        row = by_key.get(("compiled", key))
        mine = row["summary"].get(COMPILED) if row else None
        if mine is None:
            continue
        eager = row["summary"].get(EAGER, {}).get("median")
        value = mine.get("median")
        out.append({"target": f"torch.compile: SIGKILL {when} → first step of every rank "
                              f"at most {bound} s (median; eager "
                              f"{'—' if eager is None else f'{eager:.2f} s'})",
                    "value": None if value is None else round(value, 2),
                    "met": value is not None and value <= bound and mine["n_ok"] == mine["n"]})
    return out


def snapshot_targets(row: dict[str, Any] | None) -> list[dict[str, Any]]:
    """ours-snap's goodput (``row``: goodput_pair where the run has it, which charges the
    snapshots' cost): at least SNAP_GOODPUT in every run, and ahead of torchrun and NVRx in
    every pair of runs (a run without a figure fails both)."""
    mine = row["summary"].get(SNAP) if row else None
    if row is None or mine is None:
        return []
    worst = min(mine["samples"], key=lambda v: -1.0 if v is None else v)
    what = f"{row['metric']} with in-memory snapshots (ours-snap)"
    out = [{"target": f"{what} at least "
                      f"{SNAP_GOODPUT} in every run (worst run)",
            "value": None if worst is None else round(worst, 3),
            "met": worst is not None and worst >= SNAP_GOODPUT}]
    for other in ("torchrun", "nvrx"):
        if other not in row["summary"]:
            continue
        r = row.get(RATIO_KEYS[SNAP], {}).get(other)
        pairs = row["summary"][other]["n"]
        low = None if r is None else round(r["min"], 2)
        out.append({"target": f"{what} ahead of "
                              f"{LAUNCHER_TITLES[other]} in every pair (lowest ratio)",
                    "value": low,
                    "met": r is not None and r["n"] == pairs and r["min"] > 1})
    return out


def _fmt(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def _cell(entry: dict[str, Any] | None, metric: Metric) -> str:
    if entry is None:
        return "—"
    if not entry["n_ok"]:
        if "notes" not in entry:
            return "—"  # not a figure this launcher records
        return "; ".join(entry["notes"]) + f" [{entry['n']}/{entry['n']} runs]"
    d = metric.digits
    mark = ""
    if entry["bounded"]:
        mark = "≤ " if metric.better == "higher" else "≥ "
    text = f"{mark}{_fmt(entry['median'], d)} ({_fmt(entry['min'], d)}–{_fmt(entry['max'], d)})"
    if entry["n_ok"] < entry["n"]:
        text += f"; {entry['n'] - entry['n_ok']}/{entry['n']} runs: " + \
            "; ".join(entry.get("notes", []))
    return text


def _ratio_cell(entry: dict[str, Any] | None, repeat: int) -> str:
    if entry is None:
        return "—"
    mark = "≥ " if entry["bounded"] else ""
    text = f"{mark}×{entry['median']:.2f} ({entry['min']:.2f}–{entry['max']:.2f})"
    if entry["n"] < repeat:
        text += f", {entry['n']} of {repeat} pairs"
    return text


def behind(rows: list[dict[str, Any]]) -> list[str]:
    """Rows where ours (or ours-warm) is not ahead: by the median ratio, or in single pairs
    of runs."""
    out = []
    for row in rows:
        for base, key in RATIO_KEYS.items():
            who = "" if base == "ours" else f"{LAUNCHER_TITLES[base]} "
            for other, r in row.get(key, {}).items():
                low = [x for x in r["samples"] if x < 1]
                name = LAUNCHER_TITLES[other]
                if r["median"] <= 1:
                    out.append(f"{row['label']}: {who}behind {name}, median ratio "
                               f"×{r['median']:.2f}")
                elif low:
                    out.append(f"{row['label']}: {who}behind {name} in {len(low)} of "
                               f"{r['n']} pairs (lowest ×{min(low):.2f}), ahead by the median")
    return out


VARIANT_TABLES = {WARM: ("Warm restart: ours-warm against the others", "ours (cold)"),
                  SNAP: ("Snapshots: ours-snap against the others", "ours")}


def _variant_table(doc: dict[str, Any], launchers: list[str], repeat: int, base: str
                   ) -> list[str]:
    """A variant's (ours-warm's, ours-snap's) per-pair ratios against ours and the others,
    on the rows where it was measured; nothing when it was not run."""
    if base not in launchers:
        return []
    title, ours_title = VARIANT_TABLES[base]
    others = [x for x in launchers if x not in VARIANTS]
    rows = [r for r in doc["metrics"] if base in r["summary"]]
    if not rows:
        return []
    name = LAUNCHER_TITLES[base]
    head = ["measure", "unit", name,
            *(f"{name} ahead of {ours_title if x == 'ours' else LAUNCHER_TITLES[x]}"
              for x in others)]
    out = ["", f"## {title}", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        metric = next(x for x in METRICS if (x.measure, x.key) == (row["measure"],
                                                                    row["metric"]))
        cells = [row["label"], row["unit"] or "ratio", _cell(row["summary"][base], metric)]
        cells += [_ratio_cell(row.get(RATIO_KEYS[base], {}).get(x), repeat)
                  if metric.ratio else "n/a" for x in others]
        out.append("| " + " | ".join(cells) + " |")
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The results page: date, machine, command, the table, targets and notes."""
    launchers = doc["launchers"]
    # ours' columns of ratios, when ours ran
    others = [x for x in launchers if x not in ("ours", *VARIANTS)] \
        if "ours" in launchers else []
    repeat = doc["settings"]["repeat"]
    variants = "in a variant's own table: ours-warm, ours-snap" if SNAP in launchers else \
        "in the second table: ours-warm"
    m = doc["machine"]
    lines = [
        "# Benchmark: ft_launcher vs torchrun vs NVRx",
        "",
        f"- date: {doc['date']}",
        f"- machine: {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, "
        f"{m['os']}; Python {m['python']}, torch {m['torch']}; load average at start "
        f"{m['loadavg_start']}",
        f"- command: `{doc['command']}`",
        f"- {doc['settings']['repeat']} runs per launcher and measure, interleaved; "
        f"cells are median (min–max) over runs; ratios are taken per pair of runs of the "
        f"same repeat, then median (min–max); a ratio > 1 means ours ({variants}) is "
        f"better. — : not measured for that launcher (see the notes below).",
        "",
    ]
    head = ["measure", "unit", *(LAUNCHER_TITLES[x] for x in launchers),
            *(f"ours ahead of {LAUNCHER_TITLES[x]}" for x in others)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in doc["metrics"]:
        metric = next(x for x in METRICS if (x.measure, x.key) == (row["measure"],
                                                                    row["metric"]))
        cells = [row["label"], row["unit"] or "ratio"]
        cells += [_cell(row["summary"].get(x), metric) for x in launchers]
        cells += [_ratio_cell(row["ratio_vs_ours"].get(x), repeat)
                  if metric.ratio else "n/a" for x in others]
        lines.append("| " + " | ".join(cells) + " |")
    for base in VARIANTS:
        lines += _variant_table(doc, launchers, repeat, base)
    if doc["targets"]:
        lines += ["", "## Targets", "", "| target | value | met |", "|---|---|---|"]
        for t in doc["targets"]:
            lines.append(f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'NO'} |")
    lines += ["", "## Where ours is not ahead", ""]
    lines += [f"- {x}" for x in behind(doc["metrics"])] or ["- nowhere, in any pair of runs"]
    lines += ["", "## How each figure is taken", ""]
    lines += [f"- {note}" for note in doc["method"]]
    lines.append("")
    return "\n".join(lines)
