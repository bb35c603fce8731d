"""This node's standing among the others, for one cycle: the stop fence its ranks ask
about, a launcher stall after which the others may have gone on without it, and the poll
of the round's shared state (nodes waiting or lost). Through the rendezvous
(``ports.RendezvousPort``); with static addresses nothing can drop a node."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ft_launcher.hang.liveness import HangVerdict
from ft_launcher.nodes.rendezvous import RendezvousLost
from ft_launcher.policy import CycleResult, Outcome
from ft_launcher.process.worker_env import EnvDoc

if TYPE_CHECKING:
    from ft_launcher.nodes.records import Verdict
    from ft_launcher.nodes.rendezvous import RoundInfo
    from ft_launcher.ports import GroupPort, RendezvousPort

# What a rendezvous that can drop a node adds to a worker's environment, as
# docs/reference/environment.md lists it: PeerWatch.worker_env's variables, and one that
# torch's dynamic rendezvous sets in the launcher's own environment
# (nodes/torch_rendezvous.py), which the workers inherit.
PEER_ENV = (
    EnvDoc(("FT_STOP_FENCE_S", "FT_RDZV_ROUND"),
           "where the rendezvous can drop a node (not with static addresses): the shortest "
           "stop after which a thawed rank asks whether its round is still current, and the "
           "round ([several nodes](../several-nodes.md#a-frozen-node))"),
    EnvDoc(("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",),
           "`1` with torch's own dynamic rendezvous: the workers form their own store each "
           "cycle rather than share the rendezvous's"),
)


class PeerWatch:
    """This node's standing among the others (one cycle): a stall or a rank's stop fence
    may show that they went on without it; a poll shows nodes waiting or lost."""

    def __init__(self, rdzv: RendezvousPort, events: Callable[..., Any],
                 monotonic: Callable[[], float], cycle: int, rnd: RoundInfo,
                 answer: Callable[[Verdict], None] | None = None,
                 faults: list[dict[str, Any]] | None = None) -> None:
        self.rdzv, self.events, self.monotonic = rdzv, events, monotonic
        self.answer = answer  # another node's hang verdict: this node's stacks, its answer
        self.faults = faults if faults is not None else []  # the job's record
        self.cycle, self.round_no = cycle, rnd.round
        # Why a rank's stop fence found this node out of its round (reason, seconds).
        self.fenced_out: tuple[str, float] | None = None

    def worker_env(self) -> dict[str, str]:
        """Where a node can be dropped (dynamic rendezvous): the stop a rank asks about
        before going on (FT_STOP_FENCE_S, see ft_agent.stop_fence) and its round."""
        fence_s = self.rdzv.stop_fence_s
        if fence_s is None:
            return {}
        return {"FT_STOP_FENCE_S": f"{fence_s:g}", "FT_RDZV_ROUND": str(self.round_no)}

    def out_after_stall(self, group: GroupPort, stalled_s: float) -> str | None:
        """After the launcher did not run for ``stalled_s``: why this node is out of its
        round (its workers are SIGKILLed at once, before they can write a checkpoint or a
        progress file: a script without ft_agent has no stop fence), or None."""
        standing = self.rdzv.standing(stalled_s)
        if standing.current:
            return None
        group.kill_all()
        return standing.reason

    def answer_fence(self, rank: int, stopped_s: float) -> tuple[bool, str]:
        """A rank was stopped ``stopped_s`` and asks whether its round is still current."""
        standing = self.rdzv.standing(stopped_s)
        self.events("stop_fence", rank=rank, stopped_s=round(stopped_s, 3),
                    current=standing.current, reason=standing.reason)
        if not standing.current and self.fenced_out is None:
            self.fenced_out = (standing.reason, stopped_s)
        return standing.current, standing.reason

    def dropped(self, reason: str, frozen_s: float, why: str = "fenced",
                last_seen_s: float | None = None) -> CycleResult:
        """The others went on without this node (``why``: its keep-alive lapsed, as the
        coordinator saw it ``last_seen_s`` ago; or "fenced": it counted itself out): its
        workers are stopped already; it re-joins the rendezvous, as a hot spare when the
        round is full, or ends with the job (``RendezvousClosed``)."""
        self.rdzv.mark_dropped()
        self.events("node_dropped", round=self.round_no, reason=reason, why=why,
                    node=self.rdzv.node_name, last_seen_s=last_seen_s,
                    frozen_s=round(max(0.0, frozen_s), 3), next="rejoin")
        return CycleResult(self.cycle, Outcome.PEER_CHANGED, reason=f"node dropped: {reason}")

    def poll(self, group: GroupPort, since: float) -> CycleResult | None:
        """Read the round's shared state: this node dropped, nodes waiting or lost."""
        try:
            view = self.rdzv.poll_round()
        except RendezvousLost as exc:
            return CycleResult(self.cycle, Outcome.RENDEZVOUS_LOST, reason=str(exc))
        if view.dropped is not None:  # stopped inside this pass, or too slow to
            group.kill_all()  # keep alive: stale workers stop before they write
            return self.dropped(view.dropped, self.monotonic() - since, "keep-alive lapsed",
                                view.last_seen_s)
        if view.verdict is not None:
            return self.peer_hang(view.verdict)
        if view.waiting > 0 or view.lost or view.why:
            # lost: a node of this round stopped keeping alive (dead or frozen); its
            # ranks are gone from the collectives, so the round re-forms without it.
            self.events("peers_waiting", waiting=view.waiting, lost=list(view.lost),
                        why=view.why)
            return CycleResult(self.cycle, Outcome.PEER_CHANGED)
        return None

    # -- a hang verdict of another node --------------------------------------------------

    @staticmethod
    def is_peer(named: Any) -> bool:
        """A hang response named another node's rank (a ``nodes.records.Verdict``), not
        one of this node's (a ``HangVerdict``)."""
        return not isinstance(named, HangVerdict)

    def peer_hang(self, fields: dict[str, Any]) -> CycleResult:
        """Another node's hang verdict reached this node (the next round's notice): this
        node's stacks, its answer, no kill; the cycle ends for the new round."""
        from ft_launcher.nodes.records import RecordError, Verdict

        try:
            verdict = Verdict.from_dict(fields)
        except RecordError:  # checked when decoded; a bad one still ends the round
            return CycleResult(self.cycle, Outcome.PEER_CHANGED, reason="hang on a peer")
        if self.answer is not None:
            self.answer(verdict)
        return self.peer_result(verdict)

    def peer_result(self, verdict: Verdict) -> CycleResult:
        """The cycle's end for another node's hang verdict: recorded against that node."""
        self.faults.append({"cycle": self.cycle, "kind": "peer_hang", "rank": verdict.rank,
                            "host": verdict.host, "node": verdict.node,
                            "blame": verdict.blame})
        return CycleResult(self.cycle, Outcome.PEER_CHANGED,
                           reason=f"rank {verdict.rank} on {verdict.host} hung ({verdict.blame})")
