"""scripts/bench/hf_trainer.py's judgement of its targets and its page in docs/benchmarks.md,
on made-up kills (the benchmark itself runs for minutes: `--short` checks its wiring)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
from launch_helpers import ROOT

from scripts.docs import render

pytestmark = pytest.mark.stacks


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("hf_trainer_bench",
                                                  ROOT / "scripts" / "bench" / "hf_trainer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


def kills(*figures: tuple[float | None, int | None], step_s: float = 0.02) -> dict[str, Any]:
    return {"faults": [{"recovery_s": r, "redone": d} for r, d in figures], "step_s": step_s}


RUNS = {
    "ours": [kills((1.4, 30), (0.9, 12), (1.2, 40))],
    "torchrun": [kills((3.0, 20), (None, None))],
    "ours-callback": [kills((1.1, 9), (0.8, 4), (0.7, 2), step_s=0.021)],
    "ours-callback-each-step": [kills((1.1, 0), (0.8, 1), (0.7, 2), step_s=0.03)],
}


def test_targets_name_what_is_met_and_what_is_not():
    first, later, redone = BENCH.targets(RUNS, faults=3)
    assert "first kill" in first["target"] and "from the second on" in later["target"]
    assert (first["values"], first["met"]) == ([1.4], True)
    assert (later["values"], later["met"]) == ([0.9, 1.2], False)  # 1.2 s > 1.0 s
    # Judged where every step is snapshot; the default frequency's interval is the budget's.
    assert "every step" in redone["target"]
    assert (redone["values"], redone["met"]) == ([0, 1, 2], False)
    # A run cut short (fewer kills than planned) cannot meet "every kill".
    short = BENCH.targets({"ours": [kills((1.0, 3))]}, faults=3)
    assert short[0]["met"] is True and short[1]["met"] is None
    assert BENCH.targets({"torchrun": RUNS["torchrun"]}, faults=2) == []


def test_summary_splits_the_first_kill_from_the_later_ones():
    summary = BENCH.summarize(RUNS)
    assert summary["ours"]["first_recovery_s"]["median"] == 1.4
    assert summary["ours"]["later_recovery_s"] == {"median": 1.05, "min": 0.9, "max": 1.2,
                                                   "n": 2, "of": 2}
    assert summary["torchrun"]["later_recovery_s"] is None  # never recovered
    assert summary["ours-callback-each-step"]["redone"]["max"] == 2
    assert summary["ours-callback"]["step_s"]["median"] == 0.021


def test_the_rendered_section_has_a_row_per_launcher_and_the_targets():
    settings = BENCH.Settings(faults=3)
    doc = {"settings": vars(settings) | {"settle_s": list(settings.settle_s)},
           "versions": {"torch": "2.13.0", "transformers": "5.25.0"},
           "date": "2026-01-01 00:00:00 UTC", "machine": {"cpu_model": "x", "cpus": 2,
                                                         "memory_gib": 8},
           "command": "python scripts/bench/hf_trainer.py", "leftover_processes": [],
           "modes": list(RUNS), "runs": RUNS, "targets": BENCH.targets(RUNS, faults=3),
           "method": BENCH.method(settings)}
    text = "\n".join(render.hf_trainer_section(doc, "hf_trainer.json"))
    assert "## A Hugging Face Trainer killed 3 times a run (`hf_trainer.json`)" in text
    assert "| ours, defaults | 1.40 | 1.05 (0.90–1.20) | 30 (12–40) | 3 of 3 | 20.0 |" in text
    assert "| torchrun | 3.00 | — | 20 (20–20), 1 of 2 runs | 1 of 3 | 20.0 |" in text
    assert "| ours, the callback, a snapshot of every step | 1.10 | 0.75 (0.70–0.80) | " \
        "1 (0–2) | 3 of 3 | 30.0 |" in text
    assert "**not met** (0.9, 1.2)" in text and "**met** (1.4)" in text
