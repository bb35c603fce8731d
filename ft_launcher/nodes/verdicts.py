"""A hang verdict shared by every node of a round.

When a rank stops, every rank in a collective with it goes silent too, on every node, and
each node's deadlines expire within moments of each other. Each node names a culprit among
its own ranks with the evidence it has (``hang.blame``); a node that saw its rank stopped
knows, the others only guess. So the strongest evidence decides: a node with a stopped
rank writes the round's verdict at once; a node with weaker evidence first waits a moment
for a stronger verdict (``settle_s``), then writes its own only if none came (the first
writer wins). The node of the culprit opens the next round with the verdict in its notice,
which the store pushes to every node; each dumps its ranks' stacks, answers, and kills
none of them; the culprit's node waits for the answers (bounded) before it kills the
culprit, so the others' stacks show the ranks still blocked in the collective.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from ft_launcher.nodes.kv import KeyValue
from ft_launcher.nodes.records import (
    EVIDENCE,
    HANG,
    Keys,
    NodeInfo,
    Notice,
    RecordError,
    Verdict,
)

log = logging.getLogger("ft_launcher")

SETTLE_STEP_S = 1.0  # per step of weaker evidence (``records.EVIDENCE``)
ANSWER_WAIT_S = 3.0  # the culprit's node waits this long at most for the others' stacks
STRONGEST = max(EVIDENCE.values())  # a stopped rank: nothing can beat it


def settle_s(strength: int) -> float:
    """Pure: how long a node with evidence of ``strength`` waits for a stronger verdict."""
    return SETTLE_STEP_S * max(0, STRONGEST - strength)


class VerdictChannel:
    """The verdict of one round, through the round's store (the main thread's client)."""

    def __init__(self, kv: KeyValue, me: NodeInfo, round_no: int, group_rank: int,
                 nodes: int) -> None:
        self.kv, self.me = kv, me
        self.round, self.group_rank, self.nodes = round_no, group_rank, nodes

    def claim(self, rank: int, blame: str, timeout_kind: str, silence_s: float) -> Verdict:
        """This node's candidate: one of its ranks, with its evidence."""
        return Verdict(rank, self.me.node, self.me.host, self.group_rank, blame,
                       timeout_kind, round(max(0.0, silence_s), 3))

    def decide(self, claim: Verdict) -> Verdict:
        """The round's verdict: ``claim`` or a stronger (or earlier) one of another node.
        Blocks up to ``settle_s(claim.strength)``."""
        key = Keys.hang(self.round)
        wait = settle_s(claim.strength)
        if wait > 0:
            held = self.kv.wait(key, wait)
            if held is not None:
                return self._decode(held, claim)
        return self._decode(self.kv.create(key, claim.encode()), claim)

    def _decode(self, data: bytes, fallback: Verdict) -> Verdict:
        try:
            return Verdict.decode(data)
        except RecordError as exc:  # untrusted: this node's own evidence stands
            log.warning("hang: round %d's verdict is malformed (%s)", self.round, exc)
            return fallback

    def announce(self, verdict: Verdict) -> None:
        """Open the next round with the verdict: every node learns it at once."""
        notice = Notice(self.round + 1, HANG, self.me.node, verdict=asdict(verdict))
        self.kv.create(Keys.open(self.round + 1), notice.encode())

    def answer(self) -> None:
        """This node dumped its ranks' stacks for the verdict."""
        self.kv.add(Keys.hang_acks(self.round), 1)

    def await_answers(self, timeout_s: float = ANSWER_WAIT_S) -> int:
        """Wait until every other node answered (at most ``timeout_s``); how many did."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.kv.add(Keys.hang_acks(self.round), 0)
            if got >= self.nodes - 1 or time.monotonic() >= deadline:
                return got
            time.sleep(0.02)
