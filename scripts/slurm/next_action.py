#!/usr/bin/env python3
"""Decide what a Slurm job does after ft_launcher exited: finish, requeue, or stop.

Called by ``ft_sbatch.sh`` once per run of the batch script. It reads each node's
``summary.json`` and prints the decision as ``key=value`` lines on stdout (``action``,
``exit_code``, ``exclude``, ``why``) for the wrapper to act on. It never talks to Slurm
itself, so the whole table below can be tested without a cluster.

| what happened | action |
|-------------------------------------------------------|-------------------------------|
| the wrapper got SIGTERM (scancel, time limit, ...) | stop: Slurm owns the job now |
| every launcher exited 0, training finished | finished |
| the training finished on the other nodes; some nodes | finished; those nodes are |
| left the job (health check failed, died) and spares | reported (``check_nodes``), |
| took their place (the launch's status is 0) | the job is not requeued |
| exit 0 but FAULT_TOL_FINISHED_FLAG_FILE is missing | requeue (not finished yet) |
| exit 0 after USR1 and no finished flag | requeue (checkpointed, time up)|
| a summary says ``requeue: false`` | stop, print its ``why`` |
| a node left no summary.json while others wrote one | requeue, excluding that node |
| (its launcher or the node died) | |
| no node left a summary (the launch itself failed) | requeue, nobody excluded |
| USR1 came before the launcher started | requeue |
| otherwise (every summary says ``requeue: true``) | requeue, excluding its nodes |

A hot spare that was never needed exits 0 without having run a worker (its summary has an
empty ``workers`` list): it counts neither as a failure nor as the node that finished.

A requeue becomes a stop when the resubmission budget is spent (``SLURM_RESTART_COUNT``
has reached ``--max-resubmissions``) or when the exclusions would leave fewer nodes in the
partition than the job needs.

The launcher writes ``socket.gethostname()`` into ``next_action.exclude_nodes``. On a real
cluster that is the Slurm node name; where several slurmd share one host (a test cluster)
it is not. So an entry that names the host of the summary's own node is mapped to that
node's Slurm name (the name its run directory is filed under).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FINISHED = "finished"
REQUEUE = "requeue"
STOP = "stop"


class UsageError(Exception):
    """A wrong argument: reported as one line, exit status 2."""


@dataclass
class NodeResult:
    """One node's launcher outcome, read from its summary.json (None when missing)."""

    node: str
    path: Path
    summary: dict[str, Any] | None
    problem: str = ""
    missing: bool = False  # no summary.json at all: the launcher (or its node) died

    @property
    def code(self) -> int | None:
        return None if self.summary is None else _int(self.summary.get("exit_code"), 1)

    @property
    def lost_rendezvous(self) -> bool:
        """Its launcher failed because the rendezvous went away (another node's launcher,
        hosting the store, exited first): a consequence, not a cause."""
        return self.summary is not None and self.summary.get("outcome") == "rendezvous_lost"

    @property
    def unneeded_spare(self) -> bool:
        """Exited 0 without ever running a worker: a hot spare the job did not need."""
        return self.code == 0 and self.summary is not None and self.summary.get("workers") == []

    @property
    def stopped(self) -> bool:
        """Failed and asked not to be requeued (the job must stop)."""
        return bool(self.code) and not self.summary["next_action"].get("requeue", False)


@dataclass
class Inputs:
    """Everything the decision depends on."""

    launcher_exit: int
    nodes: list[NodeResult]
    restart_count: int = 0
    max_resubmissions: int = 3
    excluded: list[str] = field(default_factory=list)
    partition_nodes: list[str] = field(default_factory=list)
    nnodes: int = 1
    got_usr1: bool = False
    got_term: bool = False
    not_started: bool = False
    finished_flag_file: str = ""
    record: str = ""  # where main() appends the decision (not used by decide())


@dataclass
class Decision:
    """What the wrapper does next; ``exclude`` is the job's whole new ExcNodeList."""

    action: str
    exit_code: int
    why: str
    exclude: list[str] = field(default_factory=list)
    check_nodes: list[str] = field(default_factory=list)  # left the job: for the admin
    notes: list[str] = field(default_factory=list)  # one line per node in check_nodes


def read_summary(node: str, path: Path) -> NodeResult:
    """Load one node's summary.json; a missing or broken file is recorded, not raised."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return NodeResult(node, path, None, f"no {path} (the launcher on {node} crashed?)",
                          missing=True)
    except (OSError, ValueError) as exc:
        return NodeResult(node, path, None, f"unreadable {path}: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("next_action"), dict):
        return NodeResult(node, path, None, f"{path} has no next_action")
    return NodeResult(node, path, data)


def slurm_names(result: NodeResult, known_nodes: list[str], host_to_node: dict[str, str]
                ) -> tuple[list[str], list[str]]:
    """Map a summary's exclude_nodes to Slurm node names; returns (names, unmapped)."""
    assert result.summary is not None
    own_host = result.summary.get("host")
    names: list[str] = []
    unmapped: list[str] = []
    for entry in result.summary["next_action"].get("exclude_nodes") or []:
        if entry in (own_host, result.node):
            names.append(result.node)  # the usual case: the launcher names its own host
        elif entry in known_nodes:
            names.append(entry)
        elif entry in host_to_node:
            names.append(host_to_node[entry])
        else:
            unmapped.append(str(entry))
    return names, unmapped


def _host_map(nodes: list[NodeResult]) -> dict[str, str]:
    """host -> Slurm node for hosts that run exactly one of this job's nodes."""
    seen: dict[str, list[str]] = {}
    for r in nodes:
        if r.summary is not None and r.summary.get("host"):
            seen.setdefault(str(r.summary["host"]), []).append(r.node)
    return {host: ns[0] for host, ns in seen.items() if len(ns) == 1}


def _finished(inp: Inputs) -> tuple[bool, str]:
    """Whether a run that exited 0 everywhere means the training is done, and why."""
    flag = inp.finished_flag_file
    if flag:
        if Path(flag).exists():
            return True, f"training finished (exit 0, {flag} exists)"
        return False, f"exit 0 but the finished flag file {flag} does not exist: not finished"
    if inp.got_usr1:
        return False, "exit 0 after USR1: the training checkpointed before the time limit"
    if _departed(inp):
        return True, "training finished (the nodes that trained exited 0)"
    return True, "training finished (every launcher exited 0)"


def _exit_zero(inp: Inputs) -> bool:
    """The launch succeeded: every node finished, or left the job while a spare took its
    place (the wrapper's per-node step then exits 0 for it) and the others finished."""
    if inp.launcher_exit != 0:
        return False
    if any(r.summary is None and not r.missing for r in inp.nodes):
        return False  # an unreadable summary: nothing is known about that node
    if any(r.stopped for r in inp.nodes if r.summary is not None):
        return False
    return any(r.code == 0 and not r.unneeded_spare for r in inp.nodes)


def _departed(inp: Inputs) -> list[NodeResult]:
    """Nodes that left a job that went on without them: failed and asked for a requeue
    (a health check, restarts exhausted, an exclusion), or left no summary (died)."""
    return [r for r in inp.nodes if r.missing or (r.summary is not None and r.code != 0)]


def _node_why(r: NodeResult) -> str:
    if r.summary is None:
        return f"{r.node}: left no summary.json (its launcher or the node died)"
    why = r.summary["next_action"].get("why") or r.summary.get("reason") or ""
    return f"{r.node}: {_with_code(why or f'exit {r.code}', r.code or 0)}"


def _report_departed(inp: Inputs, decision: Decision) -> Decision:
    """Name the nodes that left the job, so that an admin can check (drain) them."""
    gone = _departed(inp)
    decision.check_nodes = [r.node for r in gone]
    decision.notes = [f"{_node_why(r)}; it left the job and a spare took its place"
                      for r in gone]
    if gone:
        decision.why += f"; {len(gone)} node(s) left the job: {','.join(decision.check_nodes)}"
    return decision


def decide(inp: Inputs) -> Decision:
    """The decision for one run of the batch script (see the module table)."""
    if inp.got_term:
        return Decision(STOP, inp.launcher_exit, "the job got SIGTERM (scancel, time limit or "
                        "a Slurm requeue): nothing to do, Slurm decides")
    if inp.not_started:
        return _requeue_or_stop(inp, 1, "USR1 (time limit near) came before the launcher "
                                "started", [])
    if _exit_zero(inp):
        done, why = _finished(inp)
        if done:  # done is done: a node that left is reported, not worth a requeue
            return _report_departed(inp, Decision(FINISHED, 0, why))
        # not finished: exit 1 if the budget stops it, so the job does not look successful;
        # the next run leaves out the nodes that left this one sick
        names = _exclusions(inp, _departed(inp))[0]
        return _report_departed(inp, _requeue_or_stop(inp, 1, why, names))
    return _after_failure(inp)


def _exclusions(inp: Inputs, results: list[NodeResult]) -> tuple[list[str], list[str]]:
    """Slurm node names that ``results`` ask to exclude, and the complaints about entries
    that cannot be mapped. A node with no summary while another node wrote one died (or
    its launcher did): it is excluded too. Where no node wrote one, the launch itself
    failed, and no node is to blame."""
    known = sorted(set(inp.partition_nodes) | set(inp.excluded) | {r.node for r in inp.nodes})
    hosts = _host_map(inp.nodes)
    someone_wrote = _someone_wrote(inp)
    names: list[str] = []
    complaints: list[str] = []
    for r in results:
        if r.missing and someone_wrote:
            names.append(r.node)
        if r.summary is None or not r.summary["next_action"].get("requeue", False):
            continue
        mapped, unmapped = slurm_names(r, known, hosts)
        names += mapped
        if unmapped:
            complaints.append(f"{r.node}: cannot map {','.join(unmapped)} to Slurm nodes, "
                              "not excluded")
    return names, complaints


def _after_failure(inp: Inputs) -> Decision:
    """Some launcher failed: stop if one says so, else requeue without its bad nodes."""
    # The job's code is a failing node's own code (srun's status says less), preferring one
    # that failed by itself over one stopped by a signal (128+N), which srun's
    # --kill-on-bad-exit sends the other nodes after the first failure, or one that lost
    # the rendezvous when the failing node's launcher (the store's host) exited.
    # A node whose summary is missing has no code of its own: srun's status stands in.
    codes: list[int] = []
    followers: list[int] = []  # codes of nodes that lost the rendezvous
    reasons: list[str] = []
    failed: list[NodeResult] = []
    for r in inp.nodes:
        if r.summary is None:
            reasons.append(r.problem + ("; excluded: it died while others wrote theirs"
                                        if r.missing and _someone_wrote(inp) else ""))
            failed.append(r)
            continue
        node_code = r.code or 0
        if node_code == 0:
            continue  # this node was fine (or a spare never needed); another one failed
        why = r.summary["next_action"].get("why") or f"exit {node_code}"
        if r.stopped:
            return Decision(STOP, node_code, f"{r.node}: {_with_code(why, node_code)}; "
                            "not requeued")
        reasons.append(f"{r.node}: {_with_code(why, node_code)}")
        failed.append(r)
        (followers if r.lost_rendezvous else codes).append(node_code)
    new_excludes, complaints = _exclusions(inp, failed)
    reasons += complaints
    codes += followers  # after the nodes that failed by themselves
    own = [c for c in codes if c < 128]
    code = (own or ([inp.launcher_exit] if inp.launcher_exit else codes) or [1])[0]
    return _requeue_or_stop(inp, code, "; ".join(reasons) or f"launcher exit {code}",
                            new_excludes)


def _someone_wrote(inp: Inputs) -> bool:
    return any(r.summary is not None for r in inp.nodes)


def _with_code(why: str, code: int) -> str:
    return why if f"exit {code}" in why else f"{why} (exit {code})"


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _requeue_or_stop(inp: Inputs, code: int, why: str, new_excludes: list[str]) -> Decision:
    if inp.restart_count >= inp.max_resubmissions:
        return Decision(STOP, code, f"{why}; resubmission budget spent ({inp.restart_count} of "
                        f"{inp.max_resubmissions} requeues done); not requeued")
    exclude = sorted(set(inp.excluded) | set(new_excludes))
    if new_excludes and inp.partition_nodes:
        left = sorted(set(inp.partition_nodes) - set(exclude))
        if len(left) < inp.nnodes:
            return Decision(STOP, code, f"{why}; excluding {','.join(exclude)} would leave "
                            f"{len(left)} node(s) for a {inp.nnodes}-node job; not requeued")
    added = sorted(set(new_excludes) - set(inp.excluded))
    note = f" excluding {','.join(added)}" if added else ""
    return Decision(REQUEUE, code, f"{why}; requeue {inp.restart_count + 1} of "
                    f"{inp.max_resubmissions}{note}", exclude)


def _csv(value: str) -> list[str]:
    return [v for v in (s.strip() for s in value.split(",")) if v and v != "(null)"]


def _non_negative(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise UsageError(f"{name} must be a non-negative integer, got {value!r}")
    return number


def parse_args(argv: list[str]) -> Inputs:
    """Build the inputs from the command line the wrapper passes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launcher-exit", required=True, help="ft_launcher's (or srun's) status")
    p.add_argument("--summary", action="append", default=[], metavar="NODE=PATH",
                   help="a node's summary.json (repeat per node)")
    p.add_argument("--restart-count", default="", help="SLURM_RESTART_COUNT (empty = 0)")
    p.add_argument("--max-resubmissions", default="3")
    p.add_argument("--excluded", default="", help="the job's current ExcNodeList, expanded")
    p.add_argument("--partition-nodes", default="", help="the partition's nodes, expanded")
    p.add_argument("--nnodes", default="1")
    p.add_argument("--got-usr1", action="store_true")
    p.add_argument("--got-term", action="store_true")
    p.add_argument("--not-started", action="store_true",
                   help="USR1 came before the launch, so the launcher never ran")
    p.add_argument("--finished-flag-file", default="")
    p.add_argument("--record", default="", metavar="FILE",
                   help="append the decision to this JSON-lines file (verdicts.jsonl)")
    a = p.parse_args(argv)
    nodes = []
    for item in a.summary:
        node, sep, path = item.partition("=")
        if not sep or not node or not path:
            raise UsageError(f"--summary must be NODE=PATH, got {item!r}")
        nodes.append(read_summary(node, Path(path)))
    if not nodes and not a.not_started:
        raise UsageError("--summary NODE=PATH is required at least once")
    return Inputs(
        launcher_exit=_non_negative("--launcher-exit", a.launcher_exit),
        nodes=nodes,
        restart_count=_non_negative("--restart-count", a.restart_count or "0"),
        max_resubmissions=_non_negative("--max-resubmissions", a.max_resubmissions),
        excluded=_csv(a.excluded),
        partition_nodes=_csv(a.partition_nodes),
        nnodes=max(1, _non_negative("--nnodes", a.nnodes)),
        got_usr1=a.got_usr1,
        got_term=a.got_term,
        not_started=a.not_started,
        finished_flag_file=a.finished_flag_file,
        record=a.record,
    )


def main(argv: list[str] | None = None) -> int:
    """Print the decision as key=value lines; exit 2 on a usage error."""
    try:
        inp = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"next_action.py: {exc}", file=sys.stderr)
        return 2
    d = decide(inp)
    print(f"action={d.action}")
    print(f"exit_code={d.exit_code}")
    print(f"exclude={','.join(d.exclude)}")
    print(f"why={_one_line(d.why)}")  # one line, whatever the summary held
    print(f"check_nodes={','.join(d.check_nodes)}")
    for note in d.notes:
        print(f"note={_one_line(note)}")
    if inp.record:
        record(Path(inp.record), inp, d)
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def record(path: Path, inp: Inputs, d: Decision) -> None:
    """Append the decision as one JSON line; a failure is reported, never fatal (the
    decision on stdout is what the wrapper acts on)."""
    line = {"ts": round(time.time(), 3), "restart_count": inp.restart_count,
            "launcher_exit": inp.launcher_exit, **asdict(d)}
    try:
        with path.open("a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
    except OSError as exc:
        print(f"next_action.py: cannot append to {path}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
