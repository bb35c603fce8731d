"""Benchmark ft_launcher against torchrun and NVRx's ft_launcher on the same CPU workload.

    python scripts/bench/bench.py                      # full run (~35 min on 2 cores)
    python scripts/bench/bench.py --quick              # shorter: 3 runs, tighter bounds
    python scripts/bench/bench.py --only heartbeat,hang --launchers ours,nvrx --repeat 3
    python scripts/bench/bench.py --long --out /tmp/long  # goodput over a long schedule
    python scripts/bench/bench.py --long --nodes 2 --snapshot-every 2s   # and a lost node

Measures: heartbeat (µs per send_heartbeat), hang (SIGSTOP -> verdict), crash (SIGKILL ->
first step of the next cycle), startup (launcher start -> first step), footprint (launcher
side CPU and memory, 8 ranks at 10 Hz), training (launcher side CPU while 2 ranks train),
goodput (fault-free wall / wall under a kill and a hang). Runs of one measure are
interleaved across launchers, so each repeat gives one pair of runs per launcher taken under
the same load; ratios are per pair.

Launchers: ours (its defaults: warm restart on), ours-cold (--no-ft-warm-restart) and
ours-warm (--ft-warm-restart --ft-preload torch,torch._dynamo), the last two only in crash,
startup and goodput, where they start or restart differently; torchrun, nvrx. On request
(--launchers), ours-snap: ours with in-memory snapshots, in startup and goodput.

--long: goodput only, on a long schedule (see PROFILES["long"]), for ours-snap, torchrun and
nvrx unless --only / --launchers say otherwise. --nodes 2: each goodput run is two launchers
on loopback (one rank each, c10d) and a spare, and a third fault loses a node (nodes_run.py).

Writes ``results.json`` and ``RESULTS.md`` to ``--out`` (default: this folder). NVRx is
installed on first use into ``.bench/nvrx-venv`` (see nvrx_env.py). Every process started is
ended by pid; everything talks over loopback.
"""

from __future__ import annotations

import argparse
import compileall
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measures  # noqa: E402
import nvrx_env  # noqa: E402
import report  # noqa: E402
from measures import Context, Launchers, Settings  # noqa: E402

log = logging.getLogger("bench")

ALL_MEASURES = ("heartbeat", "hang", "crash", "startup", "footprint", "training", "goodput")
# Run only when named in --only: the verdict's latency past the timeout, counted from the
# victim's last send_heartbeat() call (it is SIGSTOPped right after one returns).
EXTRA_MEASURES = ("verdict", "compiled")
ALL_LAUNCHERS = ("ours", measures.COLD, measures.WARM, "torchrun", "nvrx")
# Run only when named in --launchers (or by --long): ours with in-memory snapshots.
EXTRA_LAUNCHERS = (measures.SNAP,)
LAUNCHER_CHOICES = ("ours", measures.COLD, measures.WARM, measures.SNAP, "torchrun", "nvrx",
                    *measures.PLAIN)
# Snapshots change what a restart resumes from: ours-snap runs only in the fixed training.
SNAP_KINDS = ("clean", "faulted")
# torchrun has no heartbeat client and no monitor: nothing to measure for these two.
CLIENT_MEASURES = ("heartbeat", "footprint", "verdict")
# Warm restart changes how a cycle starts (the first cycle's workers and every restart's
# come from the zygote): ours-warm and ours-cold (against ours' defaults) run where that
# shows. Their fault-free runs give their start-up and the clean half of their goodput
# (their own fault-free wall over their faulted wall).
WARM_KINDS = ("crash", "faulted", "clean")

PROFILES: dict[str, Settings] = {
    "full": Settings(),
    "quick": Settings(repeat=3, hang_bound_s=10.0, crash_bound_s=45.0, footprint_window_s=5.0,
                      goodput_bound_s=45.0),
    # For the test suite: every code path of the driver once, as fast as the machine allows;
    # the training is the workload's torch-free variant (its numbers mean nothing).
    "smoke": Settings(repeat=1, hb_calls=300, hang_bound_s=1.0, crash_bound_s=15.0,
                      settle_s=0.3, footprint_ranks=2, footprint_window_s=0.5,
                      train_steps=100, ckpt_every=10, step_time=0.01, fault_after_s=0.3,
                      goodput_bound_s=12.0, start_bound_s=30.0, light=True,
                      # the torch-free training imports no torch: a cheap module keeps the
                      # standbys (and so ours-warm's wiring) quick to check
                      warm_preload="json", ours_preload="json", standby_bound_s=10.0),
    # Goodput over a long schedule: the sleep alone makes the fault-free training 5 min
    # (15,000 steps of >= 20 ms; ~26 ms a step on the 2-CPU machine, so ~6.5 min); a disk
    # checkpoint every 2,300 steps (~60 s of training there; each fault-free run records its
    # ckpt_interval_s); the kill and the hang at ~1/3 and ~2/3 of the training.
    # 200 MB of state per rank in every checkpoint and snapshot; ours-snap snapshots once a
    # second, since copying 200 MB every ~26 ms step would take most of the machine.
    "long": Settings(repeat=3, train_steps=15_000, ckpt_every=2_300,
                     fault_at_s=(130.0, 260.0), goodput_bound_s=600.0, state_mb=200,
                     snapshot_every="1s"),
}
# --nodes 2 (with --long): the kill and the hang earlier, so the lost node comes too
NODES_FAULT_AT_S = (100.0, 200.0, 300.0)
LONG_MEASURES = "goodput"
LONG_LAUNCHERS = f"{measures.SNAP},torchrun,nvrx"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--repeat", type=int, default=None,
                   help="runs per launcher and measure [5; --quick 3]")
    p.add_argument("--only", default=None,
                   help=f"comma-separated measures [{','.join(ALL_MEASURES)}; --long: "
                        f"{LONG_MEASURES}; also {','.join(EXTRA_MEASURES)}]")
    p.add_argument("--launchers", default=None,
                   help=f"comma-separated launchers [{','.join(ALL_LAUNCHERS)}; --long: "
                        f"{LONG_LAUNCHERS}; also {','.join(EXTRA_LAUNCHERS)}]")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent),
                   help="where results.json and RESULTS.md go [scripts/bench]")
    p.add_argument("--quick", action="store_true", help="3 runs, shorter bounds and windows")
    p.add_argument("--smoke", action="store_true",
                   help="one run each with tiny counts (the test suite's check)")
    p.add_argument("--long", action="store_true",
                   help="goodput over a long schedule: >= 5 min of fault-free training, a "
                        "kill and a hang at fixed times, 3 runs (~2 h 15 min)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="each goodput run on this many launchers on loopback (one rank "
                        "each) and a spare, and a third fault loses a node; goodput only [1]")
    p.add_argument("--snapshot-every", default=None, metavar="EVERY",
                   help="ours-snap's --ft-snapshot-every, e.g. 2s or 50 [1; --long: 1s]")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep each run's logs and run directories (printed at the end)")
    p.add_argument("--render", metavar="RESULTS_JSON", default=None,
                   help="run nothing: recompute the summaries of an earlier results.json "
                        "and write both files to --out")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p.parse_args(argv)


def _choice(option: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"error: {option}: expected a comma-separated subset of "
                         f"{','.join(allowed)}, got {text!r}")
    return [x for x in allowed if x in items]  # canonical order


def _selection(args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    """The measures, the launchers and the profile the options ask for."""
    if sum((args.quick, args.smoke, args.long)) > 1:
        raise SystemExit("error: --quick, --smoke and --long: choose one")
    only = args.only or (LONG_MEASURES if args.long else ",".join(ALL_MEASURES))
    default = LONG_LAUNCHERS if args.long else ",".join(ALL_LAUNCHERS)
    if "compiled" in only.split(","):  # its own pair: the same script eager and compiled
        alone = only.split(",") == ["compiled"]
        default = ",".join(measures.PLAIN if alone else (default, *measures.PLAIN))
    names = args.launchers or default
    profile = "smoke" if args.smoke else "quick" if args.quick else \
        "long" if args.long else "full"
    return (_choice("--only", only, ALL_MEASURES + EXTRA_MEASURES),
            _choice("--launchers", names, LAUNCHER_CHOICES), profile)


def on_nodes(s: Settings, nodes: int, selected: list[str]) -> Settings:
    """``s`` for goodput on ``nodes`` launchers (--nodes): a third fault, the lost node, on
    the fixed schedule too (the heartbeat timeout stays the one-node runs')."""
    if selected != ["goodput"]:
        raise SystemExit(f"error: --nodes {nodes}: goodput only (--long, or --only goodput)")
    return dataclasses.replace(s, nodes=nodes,
                               fault_at_s=NODES_FAULT_AT_S if s.fault_at_s else ())


def machine_info() -> dict[str, Any]:
    """What the numbers were taken on."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def method(s: Settings) -> list[str]:
    """How each figure is taken, with this run's counts and bounds."""
    work = ("the torch-free variant of scripts/bench/workload.py (--light: a step is a sleep; "
            "smoke only, its figures mean nothing)" if s.light else
            "scripts/bench/workload.py, a DDP model (16-32-1 MLP) on gloo over loopback")
    return [
        f"Workload: {work}, {s.nproc} local ranks, one heartbeat per step, "
        f"{s.step_time * 1000:.0f} ms of sleep per step; the same script under every "
        "launcher, only the client differs (ours: ft_agent.RankMonitorClient; NVRx: "
        "nvidia_resiliency_ext.fault_tolerance.RankMonitorClient; torchrun: none). Same "
        "environment for all: GLOO_SOCKET_IFNAME=lo, MASTER_ADDR=127.0.0.1, "
        "OMP_NUM_THREADS=1.",
        "Launchers: ours = ft_launcher of this repository with its defaults (warm restart "
        f"on{'' if s.ours_preload is None else ', --ft-preload ' + s.ours_preload}: "
        "the first cycle's workers and every restart's are forks of a zygote that imported "
        "the preloads); ours-cold = ours with --no-ft-warm-restart (every worker a fresh "
        "interpreter), measured where it starts or restarts differently (crash, startup, "
        "goodput); torchrun = python -m "
        "torch.distributed.run --standalone --local-addr 127.0.0.1 from the same torch; NVRx "
        "= ft_launcher of nvidia-resiliency-ext 0.4.1 in its own virtualenv "
        "(.bench/nvrx-venv, same torch and numpy) with --standalone --local-addr 127.0.0.1 "
        f"--ft-enable-nic-monitor false. Heartbeat timeout {s.hb_timeout_s:g} s for "
        f"ours and NVRx (initial timeout {measures.INITIAL_TIMEOUT_S:g} s); every other "
        "option at its default (NVRx's workload_check_interval is 5 s).",
        f"ours-warm = ours with --ft-warm-restart --ft-preload {s.warm_preload}: one zygote "
        "per node imports those modules once and forks the first cycle's workers (the "
        "first cycle waits for it) and then one standby per local rank, which takes over "
        "a rank at the next restart (DDP imports torch._dynamo when it is built, hence the "
        "second module). It is measured where it starts or restarts differently (crash, "
        "startup, goodput); heartbeat, hang and footprint take the same launcher code path "
        "as ours (the standbys do not touch the monitor), so those cells are —; the crash "
        "runs record the standbys' RSS and PSS from standby_ready as standby_rss_mb and "
        "standby_pss_mb. "
        "Before each fault the driver waits (at most "
        f"{s.standby_bound_s:g} s) until the launcher's events.jsonl holds a standby_ready "
        "for every local rank whose standby has not since been taken over or died; a run "
        "where that does not happen is reported as 'standby not ready', and one whose "
        "restart's workers_started does not say warm for every rank as 'not warm', never "
        "as a cold figure. The JSON keeps the warm flags and the wait per run.",
        "Faults are sent by the driver itself, by pid (each worker announces its pid), so "
        "every launcher gets the same fault the same way.",
        f"heartbeat: one rank calls send_heartbeat() {s.hb_calls:,} times back to back after "
        f"{workload_warmup()} untimed calls, each call timed with perf_counter_ns. ours' "
        "heartbeat is a non-blocking ZeroMQ send; NVRx's writes a pickle to a Unix socket "
        "and waits for the monitor's reply. torchrun has no client. Then, in the same "
        "run, as many start_section(\"compute\") + end_section(\"compute\") pairs, each "
        "pair timed: the section open+close rows (ours sends two pre-encoded frames; a "
        "client without sections, or whose section calls fail, leaves them empty with a note "
        "in the JSON).",
        f"hang: {s.settle_s:g} s after every rank's first step the driver SIGSTOPs rank 1. "
        "Verdict time: ours = ts of hang_detected in the run directory's events.jsonl; NVRx "
        "= timestamp of its rank monitor's log line 'FT timeout elapsed.' (logging's asctime, "
        "local time, milliseconds); torchrun has no verdict, so it is watched for "
        f"{s.hang_bound_s:g} s and reported as not detected. 'verdict − SIGSTOP − timeout' "
        "can be negative by up to one step: the timeout runs from the victim's last "
        "heartbeat, which came before the signal.",
        f"verdict (only with --only verdict): {s.settle_s:g} s after every rank's first step "
        "the driver reads rank 1's heartbeat mark (the workload's --hb-mark: after each "
        "send_heartbeat() returns, the call's and the return's unix time, rewritten in "
        f"place) every {measures.MARK_POLL_S * 1000:g} ms and SIGSTOPs rank 1 as soon as a "
        "new call has returned (the rank is then in its step, a heartbeat a step, so no "
        "further call precedes the stop; the JSON says late_stop when one did). Verdict "
        "time as in hang. excess_ms = verdict − (that call + timeout); after_return_ms = "
        "verdict − (its return + timeout).",
        f"crash: {s.settle_s:g} s after every rank's first step the driver SIGKILLs rank 1 "
        "(--max-restarts 1); the figure ends at the latest first step among the new cycle's "
        "ranks, bounded by "
        f"{s.crash_bound_s:g} s (ours-warm: the SIGKILL comes once its standbys are ready, "
        "so later after the first step; ours: at that time whether or not they are, and "
        "the JSON keeps its restart's warm flags). torchrun 2.13 reuses its rendezvous "
        "store across restarts "
        "and its new cycle often fails to form the gloo group (see shared/PEERS.md); such a "
        "run is reported as not recovered.",
        "startup: from just before the launcher is spawned to the latest first training step "
        "among the ranks, taken from the fault-free goodput runs.",
        f"footprint: {s.footprint_ranks} ranks do nothing but heartbeat at "
        f"{s.footprint_hz:g} Hz. From 1 s after every rank's first heartbeat, CPU time of the "
        "launcher-side processes (the launcher and every descendant that is not a worker: "
        f"NVRx's per-rank monitors) over {s.footprint_window_s:g} s; RSS and PSS "
        "(psutil memory_full_info) at the end of the window. torchrun has no monitor.",
        f"training: {s.nproc} ranks train (the crash measure's workload, a heartbeat per "
        f"step); from {s.settle_s + 1:g} s after every rank's first step, CPU time of the "
        f"launcher-side processes (as in footprint) over {s.footprint_window_s:g} s. "
        "Then the same with each step also in a 'compute' section (not torchrun: no client).",
        *_goodput_method(s),
        *_compiled_method(s),
    ]


def _compiled_method(s: Settings) -> list[str]:
    """How the compiled measure is taken."""
    early, late = s.compiled_kills_s
    return [
        "compiled (only with --only compiled): ours-eager and ours-compiled = ours with its "
        "defaults alone (--master-addr, --nproc-per-node, --max-restarts, --ft-run-dir: no "
        "heartbeat option), running the workload without a client (a torchrun script, no "
        "ft_agent): ours-eager as is, ours-compiled with the workload's --compile (the "
        "model under torch.compile, inductor, then wrapped in DDP). Every run of the pair "
        "has the same TMPDIR, where torch's compiler keeps its caches (compiled graphs, "
        "kernels, precompiled headers), filled once before the first run by a 5-step "
        "compiled training: each compiled run starts as a rerun of the job on its machine "
        "does (its first step in seconds, not the minute a first compile takes here). The "
        f"driver SIGKILLs rank 1 {early:g} s (early) and {late:g} s (late) after the first "
        "step of every rank of cycle 0, whether or not standbys are ready or learning is "
        "done (--max-restarts 2); each figure is SIGKILL → the first step of every rank of "
        "the next cycle, whose first step is the first compiled step of a new process. "
        "The JSON keeps each restart's warm flags and what the zygote had learned by each "
        "kill (modules, the compiler's warm-ups), and first_step_s (launcher start → the "
        "first step of every rank of cycle 0).",
    ]


def _goodput_method(s: Settings) -> list[str]:
    """The goodput measure's notes: its schedule, and ours-snap when it may run."""
    node = s.nodes > 1
    if s.fault_at_s:
        kill, hang, *lose = s.fault_at_s
        when = (f"SIGKILL of rank 1 {kill:g} s after the first step of cycle 0, SIGSTOP of "
                f"rank 1 {hang:g} s after it"
                + (f", the loss of a node {lose[0]:g} s after it" if node else "")
                + " (or, when the next cycle has not taken its first step by then, at that "
                "first step), the same times for every launcher")
    else:
        when = (f"SIGKILL of rank 1 {s.fault_after_s:g} s after the first step of cycle 0, "
                f"SIGSTOP of rank 1 {s.fault_after_s:g} s after the first step of cycle 1"
                + (f", the loss of a node {s.fault_after_s:g} s after the first step of "
                   "cycle 2" if node else ""))
    state = (f", {s.state_mb} MB of extra state per rank (the workload's --state-mb: a "
             "float32 tensor changed every step, in every checkpoint and snapshot)"
             if s.state_mb else "")
    return [
        f"goodput: a fixed training ({s.train_steps:,} steps of {s.step_time * 1000:g} ms "
        f"of sleep each{state}, a disk checkpoint every {s.ckpt_every:,} steps, resume "
        "from it; "
        "each fault-free run records the checkpoint interval in seconds as "
        f"ckpt_interval_s) run once fault-free and once with {3 if node else 2} faults "
        f"(--max-restarts 3): {when}; "
        "ours-warm gets each fault at that time or, when later, once its standbys are ready "
        "(so it trains longer before each fault; the work lost is what follows the last "
        "checkpoint either way, and the whole training is the same). goodput "
        "= the launcher's own fault-free wall ÷ its faulted wall; goodput_pair = the "
        "fastest fault-free wall of the same repeat, whoever ran it, ÷ this faulted wall, "
        "so what a launcher adds to every step (ours-snap's snapshots) is charged to it; "
        "its ratio between two launchers is the ratio of their faulted walls. "
        "A run that does not "
        f"finish within {s.goodput_bound_s:g} s counts as that bound (marked ≤ / ≥). "
        "Work lost per fault (lost in the JSON): the step rank 1 had finished when the "
        "fault was sent (its cycle's first step plus its heartbeats since, from the "
        "workload's --hb-mark) against the step the next cycle resumed from, and from "
        "what (snapshot, disk, none)"
        + (" (for the lost node: the step its rank had finished)." if node else
           ". A lost node needs --nodes 2: one node's faults are a killed and a stopped "
           "rank."),
        *_nodes_method(s),
        "ours-snap (only where named in --launchers, and in --long) = ours with its "
        f"defaults plus --ft-snapshot-every {s.snapshot_every}, and the workload's "
        "--snapshots: after every step each rank offers client.snapshot() its training "
        "state with the step (the launcher's option decides whether it is taken), and a "
        "restarted cycle resumes from client.restore() when it "
        "returns a snapshot, before the disk checkpoint (which it keeps writing as the "
        "others do). torchrun and NVRx resume from the disk checkpoint only.",
    ]


def _nodes_method(s: Settings) -> list[str]:
    """How a job runs on several nodes (--nodes), when it does."""
    if s.nodes < 2:
        return []
    return [
        f"Nodes (--nodes {s.nodes}): every run is {s.nodes} launchers of the same kind on "
        f"loopback, {s.nproc // s.nodes} rank each, with a c10d rendezvous (--nnodes "
        f"{s.nodes}:{s.nodes}, the first node hosts the store, --rdzv-conf is_host=true or "
        "false, one free port per run), in place of --standalone / --master-addr; once "
        "every rank has taken its first step a spare launcher joins and waits. Each node "
        "has its own directory (its run directory, its workers' events file); the "
        "checkpoint directory is shared, as on a shared file system. The lost node is "
        "the node of a rank that does not host the store: the driver SIGKILLs its "
        "launcher and every process under it (a node that dies). The job has ended when "
        "every node that ran a worker and was not lost has exited (a spare still waiting "
        "is then stopped). ours-snap also keeps a replica of each rank's snapshot on "
        "another node (--ft-snapshot-replicas 1). torchrun and NVRx take the same "
        "rendezvous options and their other options as above.",
    ]


def workload_warmup() -> int:
    import workload

    return workload.WARMUP_CALLS


def _measure_plan(selected: list[str]) -> list[tuple[str, Callable[..., dict[str, Any]]]]:
    plan: list[tuple[str, Callable[..., dict[str, Any]]]] = []
    for name in selected:
        if name == "startup" and "goodput" in selected:
            continue  # the fault-free goodput runs give the start-up figures
        if name in ("startup", "goodput"):
            plan.append(("clean", measures.clean))
            if name == "goodput":
                plan.append(("faulted", measures.faulted))
        else:
            plan.append((name, getattr(measures, name)))
    return plan


def launchers_for(kind: str, launchers: list[str]) -> list[str]:
    """Which of the selected launchers a run kind of ``_measure_plan`` is taken for."""
    out = []
    for x in launchers:
        if (kind == "compiled") != (x in measures.PLAIN):  # the pair runs there alone
            continue
        if kind in CLIENT_MEASURES and x == "torchrun":
            continue
        if x in (measures.WARM, measures.COLD) and kind not in WARM_KINDS:
            continue
        if x == measures.SNAP and kind not in SNAP_KINDS:
            continue
        out.append(x)
    return out


def run_all(ctx: Context, selected: list[str], launchers: list[str]
            ) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], list[str]]:
    """Run every selected measure ``repeat`` times per launcher, interleaved."""
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    leftovers: list[str] = []
    for kind, fn in _measure_plan(selected):
        names = launchers_for(kind, launchers)
        if not names:
            continue
        raw[kind] = {x: [] for x in names}
        for i in range(ctx.settings.repeat):
            order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
            for launcher in order:
                tag = f"{kind}-{launcher}-{i}"
                before = len(ctx.runs)
                t0 = time.monotonic()
                try:
                    result = fn(ctx, launcher, tag)
                except Exception as exc:  # one broken run must not lose the others
                    log.exception("%s failed", tag)
                    result = {"note": f"error: {type(exc).__name__}: {exc}"}
                for run in ctx.runs[before:]:
                    left = run.leftovers()
                    if left:
                        leftovers.append(f"{run.name}: {left}")
                log.info("%-22s %5.1f s  %s", tag, time.monotonic() - t0,
                         json.dumps(result, sort_keys=True))
                raw[kind][launcher].append(result)
    return _derive(raw, selected, ctx.settings.nodes), leftovers


def _derive(raw: dict[str, Any], selected: list[str], nodes: int = 1
            ) -> dict[str, dict[str, list[Any]]]:
    """Turn clean/faulted runs into the startup and goodput measures."""
    out = {k: v for k, v in raw.items() if k not in ("clean", "faulted")}
    clean = raw.get("clean", {})
    if "startup" in selected:
        out["startup"] = {x: [{k: r.get(k) for k in ("startup_s", "spawn_s", "note") if k in r}
                              for r in runs] for x, runs in clean.items()}
    if "goodput" in selected:
        out["goodput"] = {}
        for x, runs in clean.items():
            rows = []
            for c, f in zip(runs, raw["faulted"][x], strict=True):
                bounded = "wall_s" in (f.get("bounded") or [])
                row = {"clean_wall_s": c.get("wall_s"), "faulted_wall_s": f.get("wall_s"),
                       "bounded": ["faulted_wall_s", "goodput"] if bounded else [],
                       "faults": f.get("faults")}
                row.update({k: f[k] for k in ("warm", "standby_wait_s", "cold_wall_s", "lost")
                            if k in f})
                row.update({k: c[k] for k in ("ckpt_interval_s",) if k in c})
                row.update(_redone(f.get("lost"), nodes))
                if row["clean_wall_s"] and row["faulted_wall_s"]:
                    row["goodput"] = round(row["clean_wall_s"] / row["faulted_wall_s"], 4)
                else:
                    row["goodput"] = None
                notes = [n for n in (c.get("note"), f.get("note")) if n]
                if notes:
                    row["note"] = "; ".join(notes)
                rows.append(row)
            out["goodput"][x] = rows
        _goodput_against_pair(out["goodput"])
    return out


def _goodput_against_pair(rows: dict[str, list[dict[str, Any]]]) -> None:
    """Add ``goodput_pair``: the fastest fault-free wall of the same repeat, whoever ran it,
    over this faulted wall. Unlike ``goodput`` (a launcher's own fault-free wall), it charges
    what a launcher adds to every step, such as ours-snap's snapshots."""
    for i in range(max((len(r) for r in rows.values()), default=0)):
        pair = [r[i] for r in rows.values() if i < len(r)]
        cleans = [row["clean_wall_s"] for row in pair if row["clean_wall_s"]]
        for row in pair:
            ok = cleans and row["faulted_wall_s"]
            row["goodput_pair"] = round(min(cleans) / row["faulted_wall_s"], 4) if ok else None
            if "goodput" in row["bounded"]:
                row["bounded"] = [*row["bounded"], "goodput_pair"]


def _redone(lost: list[dict[str, Any] | None] | None, nodes: int = 1
            ) -> dict[str, int | None]:
    """Steps redone after the kill, the hang and (on several ``nodes``) the lost node, from
    a faulted run's ``lost`` (None where a fault was not sent or no next cycle resumed)."""
    keys = ["redone_kill", "redone_hang"] + (["redone_node"] if nodes > 1 else [])
    found = [(x or {}).get("redone") for x in lost or []]
    found += [None] * (len(keys) - len(found))
    return dict(zip(keys, found, strict=False))


def write(doc: dict[str, Any], out: Path) -> None:
    """Summaries, ratios and targets from the raw figures; results.json and RESULTS.md."""
    raw = doc["raw"]
    doc["metrics"] = [report.summarize(m, raw[m.measure]) for m in report.METRICS
                      if m.measure in raw and _recorded(m.key, raw[m.measure])]
    doc["targets"] = report.targets(doc["metrics"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    (out / "RESULTS.md").write_text(report.markdown(doc))
    log.info("wrote %s and %s", out / "results.json", out / "RESULTS.md")


def _recorded(key: str, runs: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether any run has ``key`` (a figure only some schedules have, such as the steps
    redone after a lost node, is left out of the others' tables)."""
    return any(key in r for results in runs.values() for r in results)


def render(path: Path, out: Path) -> int:
    """--render: the files again from an earlier run's raw figures (nothing is run)."""
    try:
        doc = json.loads(path.read_text())
        doc["raw"]  # noqa: B018 - a results.json has it; anything else is the wrong file
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"error: --render: cannot read {path}: {exc!r}") from None
    write(doc, out)
    return 0


class Interrupted(BaseException):  # not an Exception: a failed run's handler must not eat it
    """SIGTERM, SIGINT or SIGHUP reached the driver: unwind so every run ends its processes."""


def _interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def compile_ours() -> None:
    """Compile ours to bytecode once, as pip does for an installed package (torchrun's and
    NVRx's are): an editable checkout run with PYTHONDONTWRITEBYTECODE set would otherwise
    compile every module again at each launcher and worker start."""
    repo = Path(__file__).resolve().parents[2]
    for package in ("ft_launcher", "ft_agent", "rerun"):
        compileall.compile_dir(repo / package, quiet=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Set explicitly: a driver started in the background inherits SIGINT ignored, and the
    # default SIGTERM would end it without stopping the launchers it started.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="[bench %(asctime)s] %(message)s", stream=sys.stderr)
    if args.render:
        return render(Path(args.render), Path(args.out))
    selected, launchers, profile = _selection(args)
    settings = dataclasses.replace(PROFILES[profile])
    if args.repeat is not None:
        if args.repeat < 1:
            raise SystemExit(f"error: --repeat: expected a positive count, got {args.repeat}")
        settings.repeat = args.repeat
    if args.nodes > 1:
        settings = on_nodes(settings, args.nodes, selected)
    if args.snapshot_every is not None:
        from ft_launcher.config import ConfigError, parse_ft_value  # noqa: PLC0415
        try:
            every = parse_ft_value("snapshot_every", args.snapshot_every, "--snapshot-every")
        except ConfigError as exc:
            raise SystemExit(f"error: {exc}") from None
        if every is None:
            raise SystemExit("error: --snapshot-every: ours-snap needs snapshots, got off")
        settings.snapshot_every = every

    machine = machine_info()
    compile_ours()
    lnch = Launchers.default()
    if "nvrx" in launchers:
        try:
            env = nvrx_env.ensure()
        except nvrx_env.NvrxEnvError as exc:
            raise SystemExit(f"error: NVRx baseline: {exc}") from None
        lnch.nvrx = [str(env.launcher)]
    root = Path(tempfile.mkdtemp(prefix="ftb-"))  # short: AF_UNIX paths live under it
    ctx = Context(launchers=lnch, settings=settings, root=root)
    t0 = time.monotonic()
    try:
        raw, leftovers = run_all(ctx, selected, launchers)
    except Interrupted as exc:
        log.error("stopped by %s; every run's processes were ended", exc)
        return 130
    finally:
        if not args.keep_runs:
            shutil.rmtree(root, ignore_errors=True)
    doc = {
        "version": 1,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine,
        "command": shlex.join(["python", "scripts/bench/bench.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "profile": profile,
        "settings": vars(settings),
        "launchers": launchers,
        "versions": {"torch": machine["torch"], "nvrx": nvrx_env.NVRX_REQ.split("==")[1]},
        "duration_s": round(time.monotonic() - t0, 1),
        "raw": raw,
        "leftover_processes": leftovers,
        "method": method(settings),
    }
    write(doc, Path(args.out))
    log.info("took %.0f s", doc["duration_s"])
    if args.keep_runs:
        log.info("run directories kept in %s", root)
    if leftovers:
        log.error("processes left behind: %s", leftovers)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
