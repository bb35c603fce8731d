"""The response to a hang: every rank's stacks (and NCCL traces), the blame, the kill.

A deadline expired for one rank, but in a collective every rank goes silent with the one
that stopped: the stacks and each rank's silence choose the culprit (``blame.choose``),
and only the culprit is killed. With several nodes the verdict is the round's, not this
node's alone (``nodes.verdicts``): the node with the strongest evidence names the culprit,
every node dumps its ranks' stacks, and only the culprit's node kills.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ft_launcher.hang import blame, nccl_trace, stacks
from ft_launcher.hang.liveness import HangVerdict
from ft_launcher.process.workers import Worker, WorkerGroup

log = logging.getLogger("ft_launcher")

if TYPE_CHECKING:  # several nodes only: one node imports none of the rendezvous
    from ft_launcher.nodes.records import Verdict


class HangFacts(Protocol):
    """What the hang response asks the monitor (``monitor.Monitor`` has it)."""

    def silent_ranks(self, verdict: HangVerdict, now: float) -> dict[int, float]: ...
    def local_rank(self, rank: int) -> int: ...
    def agent_pid(self, rank: int) -> int | None: ...
    def stack_file(self, rank: int) -> Path | None: ...


@dataclass
class HangResponse:
    """Answers one hang verdict of a cycle: ``respond(group, verdict)`` returns the verdict
    about the culprit (it may name another rank than the one whose deadline expired)."""

    monitor: HangFacts
    stacks_dir: Path
    cycle: int
    kill_signal: int
    events: Callable[..., Any]
    host: str = ""
    is_stopped: Callable[[int], bool] = stacks.is_stopped
    verdicts: Any = None  # nodes.verdicts.VerdictChannel: the round's verdict, several nodes

    def respond(self, group: WorkerGroup, verdict: HangVerdict) -> HangVerdict | Verdict:
        """Answer this node's verdict: the culprit named and killed (a ``HangVerdict``),
        or, with several nodes, another node's verdict (a ``Verdict``: nothing killed
        here)."""
        detected_at, checked = time.time(), time.monotonic()
        texts = self.dump_stacks(group)
        # Silences as of the verdict, not after the stacks were taken (tens of ms).
        silent = self.monitor.silent_ranks(verdict, checked)
        alive = {w.rank: w for w in group.alive()}
        suspects = [blame.Suspect(rank, age, self.is_stopped(alive[rank].pid),
                                  blame.in_collective(texts.get(rank)))
                    for rank, age in silent.items() if rank in alive]
        culprit = blame.choose(suspects) if suspects else None
        expired = verdict
        if culprit is not None and culprit.rank != verdict.rank:
            verdict = HangVerdict(culprit.rank, self.monitor.local_rank(culprit.rank),
                                  verdict.timeout_kind, verdict.timeout_s, silent[culprit.rank])
        why = culprit.why if culprit else "expired_first"
        shared = None
        if self.verdicts is not None:
            claim = self.verdicts.claim(verdict.rank, why, verdict.timeout_kind,
                                        verdict.silence_s)
            shared = self.verdicts.decide(claim)
            if shared.node != claim.node:
                self.answer_peer(group, shared, texts)
                return shared
        self.events("hang_detected", rank=verdict.rank, timeout_kind=verdict.timeout_kind,
                    timeout_s=verdict.timeout_s, silence_s=verdict.silence_s,
                    expired_rank=expired.rank, expired_silence_s=expired.silence_s,
                    detected_at=round(detected_at, 6), blame=why,
                    suspects=culprit.suspects if culprit else [], host=self.host)
        answered = None
        if shared is not None:  # the others dump their stacks before the culprit dies
            self.verdicts.announce(shared)
            answered = self.verdicts.await_answers()
        self.kill(group, alive.get(verdict.rank), answered)
        return verdict

    def answer_peer(self, group: WorkerGroup, verdict: Verdict,
                    texts: dict[int, str] | None = None) -> None:
        """Another node named a rank of its own: dump this node's stacks (unless just
        dumped), say so, kill nothing."""
        if texts is None:
            self.dump_stacks(group)
        self.events("peer_verdict", rank=verdict.rank, node=verdict.node, host=verdict.host,
                    group_rank=verdict.group_rank, blame=verdict.blame,
                    timeout_kind=verdict.timeout_kind, silence_s=verdict.silence_s)
        if self.verdicts is not None:
            try:
                self.verdicts.answer()
            except ConnectionError as exc:  # the store is gone: the round ends anyway
                log.warning("hang: cannot answer node %s's verdict: %s", verdict.node, exc)

    def kill(self, group: WorkerGroup, victim: Worker | None,
             answered: int | None = None) -> None:
        """SIGCONT and the termination signal to the culprit; ``answered``: how many other
        nodes dumped their stacks first (several nodes)."""
        if victim is None:
            return
        signum = self.kill_signal
        group.send_signal(victim, signal.SIGCONT)
        group.send_signal(victim, signum)
        extra = {} if answered is None else {"peers_answered": answered}
        self.events("rank_killed", rank=victim.rank, pid=victim.pid,
                    signal=signal.Signals(signum).name, reason="hang", **extra)

    def dump_stacks(self, group: WorkerGroup) -> dict[int, str]:
        """Stacks of every live local rank, written to stacks/; returns them by rank."""
        alive = group.alive()
        targets = [stacks.StackTarget(w.rank, w.pid, self.monitor.agent_pid(w.rank),
                                      self.monitor.stack_file(w.rank)) for w in alive]
        by_rank = {w.rank: w for w in alive}
        # NCCL's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE set) dumps on a pipe request,
        # collected below next to the Python stacks.
        traces = nccl_trace.trace_settings(alive[0].spec.env) if alive else None
        asked_at = time.time()
        asked = nccl_trace.request_dumps(traces, list(by_rank)) if traces else []

        def signal_agent(t: stacks.StackTarget) -> bool:
            return t.agent_pid is not None and group.signal_process(
                by_rank[t.rank], t.agent_pid, stacks.STACK_SIGNAL)

        texts = stacks.capture(targets, signal_agent, stacks.find_py_spy())
        dumped = stacks.write(self.stacks_dir, self.cycle, texts)
        self.events("stacks_dumped", ranks=dumped,
                    missing=[w.rank for w in alive if w.rank not in dumped])
        if traces is not None:
            got = nccl_trace.collect_traces(
                self.stacks_dir, self.cycle, traces.dump_prefix, list(by_rank),
                since=asked_at, wait_s=max(0.0, asked_at + nccl_trace.WAIT_S - time.time()))
            self.events("nccl_traces_collected", ranks=sorted(got.collected), asked=asked,
                        missing=got.missing)
        return texts
