"""The hang monitor: one ZeroMQ ROUTER socket for every local rank, and their deadlines.

The monitor owns no thread. The supervisor polls its socket together with the signal
wake-up fd and calls ``handle_messages`` and ``check_deadlines``; ``next_deadline`` tells it
how long it may sleep, so a verdict lands within milliseconds of the timeout.

Timeouts in force, per kind: a calculated value (asked for by a rank, or loaded from the
state file) beats the configured one. A heartbeat timeout left unset is learned: once
``AUTO_MIN_INTERVALS`` heartbeat intervals were seen, the monitor arms
``max(safety_factor x longest interval, AUTO_MIN_TIMEOUT_S)`` by itself.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from ft_agent import protocol
from ft_launcher.config import FaultToleranceConfig
from ft_launcher.rundir import write_json_atomic

log = logging.getLogger("ft_launcher")

STACK_SIGNAL = signal.SIGUSR2
AUTO_MIN_INTERVALS = 100
AUTO_MIN_TIMEOUT_S = 300.0
# A calculated timeout is never shorter than this: intervals of microseconds (sections back
# to back) times any factor would turn scheduling noise into hang verdicts.
MIN_CALCULATED_TIMEOUT_S = 1.0
SAMPLES_KEPT = 20_000  # per rank and kind, for the interval statistics
STATE_VERSION = 1

HB = "heartbeat"
INITIAL = "initial"
OUT_OF_SECTION = "out_of_section"

TIMEOUT_KEYS = {
    INITIAL: "initial_rank_heartbeat_timeout",
    HB: "rank_heartbeat_timeout",
    OUT_OF_SECTION: "rank_out_of_section_timeout",
}


@dataclass
class HangVerdict:
    """Which rank went silent, for which timeout, and for how long."""

    rank: int
    local_rank: int
    timeout_kind: str  # "initial", "heartbeat", "out_of_section" or "section:<name>"
    timeout_s: float
    silence_s: float


@dataclass
class Samples:
    """Intervals of one kind for one rank: exact count/min/max, a bounded sample for ranks."""

    count: int = 0
    lo: float = float("inf")
    hi: float = 0.0
    kept: list[float] = field(default_factory=list)

    def add(self, value: float, rng: random.Random) -> None:
        self.count += 1
        self.lo, self.hi = min(self.lo, value), max(self.hi, value)
        if len(self.kept) < SAMPLES_KEPT:
            self.kept.append(value)
        else:  # reservoir sampling keeps the sample uniform over the whole cycle
            j = rng.randrange(self.count)
            if j < SAMPLES_KEPT:
                self.kept[j] = value

    def stats(self) -> dict[str, float]:
        ordered = sorted(self.kept)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

        return {
            "count": self.count,
            "min": round(self.lo, 6),
            "p50": round(pct(0.5), 6),
            "p99": round(pct(0.99), 6),
            "max": round(self.hi, 6),
        }


@dataclass
class RankState:
    """What the monitor knows about one local rank in this cycle."""

    rank: int
    local_rank: int
    pid: int
    spawned_at: float  # monotonic clock
    identity: bytes | None = None
    active: bool = True  # False after goodbye or exit: no deadlines
    first_activity: float | None = None
    last_hb: float | None = None
    sections: dict[str, float] = field(default_factory=dict)  # open name -> opened at
    last_section_end: float | None = None
    samples: dict[str, Samples] = field(default_factory=dict)
    stack_file: Path | None = None


class Monitor:
    """ROUTER socket, authentication, interval bookkeeping and hang verdicts."""

    def __init__(
        self,
        endpoint: str,
        token: str,
        cfg: FaultToleranceConfig,
        state_path: Path,
        events: Any,
    ) -> None:
        self.endpoint = endpoint
        self.token = token
        self.cfg = cfg
        self.state_path = state_path
        self.events = events  # callable(name, **fields) that records an event
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.bind(endpoint)
        self.ranks: dict[int, RankState] = {}
        self.by_identity: dict[bytes, RankState] = {}
        self.cycle = 0
        self.private_dir: Path | None = None
        self.counters: dict[str, int] = {}
        self.diagnoses: list[dict[str, Any]] = []
        self.controls: list[tuple[int, str]] = []
        self._rng = random.Random(0)
        self._hb_count, self._hb_longest = 0, 0.0  # heartbeat intervals of this cycle
        self.state = self._load_state()

    # -- cycle lifecycle ---------------------------------------------------------------

    def start_cycle(self, cycle: int, workers: list[Any], private_dir: Path) -> None:
        """Forget the previous cycle's ranks; clocks start at each worker's spawn."""
        self.cycle = cycle
        self.private_dir = private_dir
        self.ranks = {
            w.rank: RankState(w.rank, w.local_rank, w.pid, spawned_at=self._mono(w.started_at))
            for w in workers
        }
        self.by_identity = {}
        self.diagnoses = []
        self.controls = []
        self._hb_count, self._hb_longest = 0, 0.0

    def end_cycle(self) -> dict[int, dict[str, dict[str, float]]]:
        """Fold this cycle's observations into the state file; return per-rank stats."""
        stats = {}
        observed = self.state["observed"]
        for r in self.ranks.values():
            stats[r.rank] = {kind: s.stats() for kind, s in r.samples.items() if s.count}
            for kind, s in r.samples.items():
                if s.count:
                    observed[kind] = max(observed.get(kind, 0.0), s.hi)
        self._save_state()
        for r in self.ranks.values():
            if r.stack_file is not None:
                r.stack_file.unlink(missing_ok=True)
        return stats

    def rank_exited(self, rank: int) -> None:
        if rank in self.ranks:
            self.ranks[rank].active = False

    def close(self) -> None:
        self.sock.close(linger=0)

    # -- timeouts ----------------------------------------------------------------------

    def timeout_for(self, kind: str) -> float | None:
        """The timeout in force for a kind ("initial", "heartbeat", "out_of_section",
        "section:<name>"): calculated, else configured, else learned (heartbeats only)."""
        calculated = self.state["calculated"]
        if kind.startswith("section:"):
            name = kind[len("section:"):]
            value = calculated.get("rank_section_timeouts", {}).get(name)
            return value if value is not None else self.cfg.rank_section_timeouts.get(name)
        key = TIMEOUT_KEYS[kind]
        if calculated.get(key) is not None:
            return calculated[key]
        configured = getattr(self.cfg, key)
        if configured is not None or kind == OUT_OF_SECTION:
            return configured
        return self._learned(kind)

    def _learned(self, kind: str) -> float | None:
        longest = self.state["observed"].get(kind)
        if kind == HB:
            # Running totals: this is asked for every rank at every wake-up.
            if self._hb_count < AUTO_MIN_INTERVALS and longest is None:
                return None
            longest = max(self._hb_longest, longest or 0.0)
        if not longest:
            return None
        return max(self.cfg.safety_factor * longest, AUTO_MIN_TIMEOUT_S)

    def timeouts_in_force(self) -> dict[str, Any]:
        names = set(self.cfg.rank_section_timeouts) | set(
            self.state["calculated"].get("rank_section_timeouts", {})
        )
        result: dict[str, Any] = {key: self.timeout_for(kind) for kind, key in TIMEOUT_KEYS.items()}
        result["rank_section_timeouts"] = {n: self.timeout_for(f"section:{n}") for n in names}
        return result

    def _calculate(self, what: str, msg: dict[str, Any]) -> tuple[bool, str | None]:
        factor = self.cfg.safety_factor
        calculated = self.state["calculated"]

        def longest(kind: str) -> float | None:
            values = [r.samples[kind].hi for r in self.ranks.values() if kind in r.samples]
            values += [self.state["observed"][kind]] if kind in self.state["observed"] else []
            return max(values) if values else None

        def merge(key: str, value: float | None, into: dict[str, Any]) -> None:
            # Merged with earlier calculated values: a timeout only grows, so a slow
            # interval seen in an earlier cycle is never forgotten.
            if value is not None:
                new = max(factor * value, MIN_CALCULATED_TIMEOUT_S)
                into[key] = round(max(new, into.get(key) or 0.0), 6)

        if what == "hb":
            hb = longest(HB)
            if hb is None:
                return False, "no heartbeat interval observed yet"
            merge(TIMEOUT_KEYS[HB], hb, calculated)
            merge(TIMEOUT_KEYS[INITIAL], longest(INITIAL), calculated)
        elif what == "sections":
            wanted = msg.get("sections")
            names = {k.split(":", 1)[1] for r in self.ranks.values() for k in r.samples
                     if k.startswith("section:")}
            if isinstance(wanted, list):
                names &= {str(n) for n in wanted}
            sections = calculated.setdefault("rank_section_timeouts", {})
            for name in sorted(names):
                merge(name, longest(f"section:{name}"), sections)
            if msg.get("out_of_section", True):
                merge(TIMEOUT_KEYS[OUT_OF_SECTION], longest(OUT_OF_SECTION), calculated)
        else:
            return False, f"unknown calculation {what!r}"
        self._save_state()
        self.events("timeouts_updated", what=what, timeouts=self.timeouts_in_force())
        return True, None

    def _set_timeouts(self, timeouts: dict[str, Any]) -> tuple[bool, str | None]:
        calculated = self.state["calculated"]
        for key, value in timeouts.items():
            if key == "rank_section_timeouts" and isinstance(value, dict):
                calculated.setdefault(key, {}).update(
                    {str(k): float(v) for k, v in value.items() if isinstance(v, (int, float))}
                )
            elif key in TIMEOUT_KEYS.values() and isinstance(value, (int, float)):
                calculated[key] = float(value)
            elif value is not None:
                return False, f"unknown or malformed timeout {key!r}"
        self._save_state()
        self.events("timeouts_updated", what="loaded", timeouts=self.timeouts_in_force())
        return True, None

    # -- messages ----------------------------------------------------------------------

    def all_connected(self) -> bool:
        """Every rank of the cycle said hello (so nobody waits for a reply)."""
        return all(r.identity is not None for r in self.ranks.values())

    def handle_messages(self, budget: int = 10_000) -> int:
        """Drain the socket without blocking (at most ``budget`` frames); return the count."""
        now = time.monotonic
        for handled in range(budget):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            if len(frames) != 2:
                self._count("malformed", f"{len(frames)} frames")
                continue
            identity, frame = frames
            try:
                msg = protocol.decode(frame)
            except protocol.ProtocolError as exc:
                self._count("malformed", str(exc))
                continue
            self._dispatch(identity, msg, now())
        return budget

    def _dispatch(self, identity: bytes, msg: dict[str, Any], t: float) -> None:
        kind = msg["k"]
        if kind == protocol.HELLO:
            self._hello(identity, msg, t)
            return
        r = self.by_identity.get(identity)
        if r is None:
            self._count("unauthenticated", f"{kind} from a peer without a valid hello")
            return
        if not r.active and kind != protocol.DIAGNOSIS:
            return
        t = self._sent_at(r, msg, t)
        if kind == protocol.HEARTBEAT:
            self._activity(r, t)
            if r.last_hb is not None:
                self._sample(r, HB, t - r.last_hb)
            r.last_hb = t
        elif kind == protocol.SECTION_OPEN:
            self._activity(r, t)
            name = msg["name"]
            if name not in self.cfg.rank_section_timeouts and name not in self.state[
                "calculated"
            ].get("rank_section_timeouts", {}):
                self._count(f"unknown_section:{name}", f"section {name!r} has no timeout")
            if r.last_section_end is not None and not r.sections:
                self._sample(r, OUT_OF_SECTION, t - r.last_section_end)
            r.sections[name] = t
        elif kind == protocol.SECTION_CLOSE:
            opened = r.sections.pop(msg["name"], None)
            if opened is None:
                self._count("close_unopened", f"end of section {msg['name']!r} never opened")
                return
            self._sample(r, f"section:{msg['name']}", t - opened)
            r.last_section_end = t
        elif kind == protocol.SECTION_CLOSE_ALL:
            for name, opened in r.sections.items():
                self._sample(r, f"section:{name}", t - opened)
            if r.sections:
                r.last_section_end = t
            r.sections.clear()
        elif kind == protocol.CALCULATE:
            ok, error = self._calculate(msg["what"], msg)
            self._reply(identity, protocol.ACK, req=msg["req"], ok=ok, error=error,
                        timeouts=self.timeouts_in_force())
        elif kind == protocol.SET_TIMEOUTS:
            ok, error = self._set_timeouts(msg["timeouts"])
            self._reply(identity, protocol.ACK, req=msg["req"], ok=ok, error=error,
                        timeouts=self.timeouts_in_force())
        elif kind == protocol.CONTROL:
            if msg["action"] not in protocol.CONTROL_ACTIONS:
                self._count("malformed", f"unknown control action {msg['action']!r}")
                return
            self.controls.append((r.rank, msg["action"]))
            self.events("workload_control", rank=r.rank, action=msg["action"])
        elif kind == protocol.DIAGNOSIS:
            fields = {k: v for k, v in msg.items() if k not in ("v", "k")}
            self.diagnoses.append({"rank": r.rank, **fields})
            self.events("diagnosis", **{"rank": r.rank, **fields})
        elif kind == protocol.REPORT:
            self.events("rank_report", rank=r.rank, what=msg["what"], message=msg["message"])
            if msg["what"] == "simulated_fault":
                self._agent_fault(r, msg["message"])
        elif kind == protocol.GOODBYE:
            r.active = False
            self.events("rank_goodbye", rank=r.rank)
        else:
            self._count("unexpected", f"{kind} is not a message a rank sends")

    def _agent_fault(self, r: RankState, message: str) -> None:
        # A fault the rank inflicts on itself (the Lightning callback) is recorded like one
        # the launcher delivers, so ft_report pairs it with its detection and restart.
        try:
            fault = json.loads(message)
            fields = {"fault_type": str(fault["fault_type"]), "at": float(fault["at"])}
        except (ValueError, KeyError, TypeError):
            self._count("malformed", f"simulated_fault report {message[:80]!r}")
            return
        self.events("fault_injected", rank=r.rank, pid=r.pid, source="agent", **fields)

    def _hello(self, identity: bytes, msg: dict[str, Any], t: float) -> None:
        error = None
        r = self.ranks.get(msg["rank"])
        if not hmac.compare_digest(msg["token"].encode(), self.token.encode()):
            error = "wrong token"
        elif msg["cycle"] != self.cycle:
            error = f"stale cycle {msg['cycle']} (now {self.cycle})"
        elif r is None or r.local_rank != msg["local_rank"]:
            error = f"rank {msg['rank']} / local rank {msg['local_rank']} is not on this node"
        if error is not None:
            self._count("rejected_hello", error)
            self._reply(identity, protocol.CONFIG, ok=False, error=error)
            return
        assert r is not None
        if r.identity is not None:
            self.by_identity.pop(r.identity, None)
        r.identity = identity
        r.pid = msg["pid"]
        r.active = True  # a rank may say goodbye and connect again (a second fit())
        self.by_identity[identity] = r
        assert self.private_dir is not None
        r.stack_file = self.private_dir / f"stack_c{self.cycle}_r{r.rank}.raw"
        r.stack_file.touch(mode=0o600)
        self.events("rank_connected", rank=r.rank, pid=r.pid, host=msg["host"],
                    after_s=round(t - r.spawned_at, 3))
        self._reply(
            identity,
            protocol.CONFIG,
            ok=True,
            timeouts=self.timeouts_in_force(),
            stack_file=str(r.stack_file),
            stack_signal=int(STACK_SIGNAL),
        )

    @staticmethod
    def _sent_at(r: RankState, msg: dict[str, Any], received: float) -> float:
        """When an activity message was sent: its own monotonic stamp, kept between the
        rank's previous activity and the time it was read (a bogus stamp cannot move a
        deadline into the future or the past); the read time when it has none."""
        stamp = msg.get("t")
        if not isinstance(stamp, float):
            return received
        floor = max(r.last_hb or r.spawned_at, r.last_section_end or r.spawned_at,
                    max(r.sections.values(), default=r.spawned_at))
        return min(max(stamp, floor), received)

    def _reply(self, identity: bytes, kind: str, **fields: Any) -> None:
        try:
            self.sock.send_multipart([identity, protocol.encode(kind, **fields)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("cycle %d: cannot reply %s: %s", self.cycle, kind, exc)

    def _activity(self, r: RankState, t: float) -> None:
        if r.first_activity is None:
            r.first_activity = t
            self._sample(r, INITIAL, t - r.spawned_at)

    def _sample(self, r: RankState, kind: str, value: float) -> None:
        samples = r.samples.get(kind)
        if samples is None:
            samples = r.samples[kind] = Samples()
        samples.add(value, self._rng)
        if kind == HB:
            self._hb_count += 1
            self._hb_longest = max(self._hb_longest, value)

    def _count(self, what: str, detail: str) -> None:
        n = self.counters.get(what, 0) + 1
        self.counters[what] = n
        if n == 1:  # logged once per kind, counted always
            log.warning("cycle %d: monitor ignored a message: %s", self.cycle, detail)

    @staticmethod
    def _mono(wall: float) -> float:
        # Workers record their spawn time on the wall clock; compare on the monotonic one.
        return time.monotonic() - (time.time() - wall)

    # -- deadlines ---------------------------------------------------------------------

    def _deadlines(self, r: RankState) -> list[tuple[float, str, float, float]]:
        """(deadline, kind, timeout, reference time) for one rank, monotonic clock."""
        out = []
        if r.first_activity is None:
            timeout = self.timeout_for(INITIAL)
            if timeout is not None:
                ref = r.spawned_at
                out.append((ref + timeout, INITIAL, timeout, ref))
            return out
        if r.last_hb is not None:
            timeout = self.timeout_for(HB)
            if timeout is not None:
                out.append((r.last_hb + timeout, HB, timeout, r.last_hb))
        for name, opened in r.sections.items():
            timeout = self.timeout_for(f"section:{name}")
            if timeout is not None:
                out.append((opened + timeout, f"section:{name}", timeout, opened))
        if not r.sections and r.last_section_end is not None:
            timeout = self.timeout_for(OUT_OF_SECTION)
            if timeout is not None:
                ref = r.last_section_end
                out.append((ref + timeout, OUT_OF_SECTION, timeout, ref))
        return out

    def next_deadline(self) -> float | None:
        """Earliest monotonic deadline over all active ranks, or None."""
        times = [d[0] for r in self.ranks.values() if r.active for d in self._deadlines(r)]
        return min(times) if times else None

    def check_deadlines(self) -> HangVerdict | None:
        """The first rank past a deadline, if any (earliest deadline wins)."""
        now = time.monotonic()
        worst = None
        for r in self.ranks.values():
            if not r.active:
                continue
            for deadline, kind, timeout, ref in self._deadlines(r):
                if deadline <= now and (worst is None or deadline < worst[0]):
                    worst = (deadline, r, kind, timeout, now - ref)
        if worst is None:
            return None
        _, r, kind, timeout, silence = worst
        return HangVerdict(r.rank, r.local_rank, kind, timeout, round(silence, 3))

    # -- state file --------------------------------------------------------------------

    def _load_state(self) -> dict[str, Any]:
        empty = {"version": STATE_VERSION, "observed": {}, "calculated": {}}
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return empty
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable state file %s: %s", self.state_path, exc)
            return empty
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            log.warning("ignoring state file %s of another version", self.state_path)
            return empty
        state.setdefault("observed", {})
        state.setdefault("calculated", {})
        return state

    def _save_state(self) -> None:
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.state_path, self.state)
        except OSError as exc:
            log.warning("cannot write state file %s: %s", self.state_path, exc)

    # -- stacks ------------------------------------------------------------------------

    def request_stacks(self, skip: set[int]) -> dict[int, int]:
        """Ask every connected rank not in ``skip`` for its stacks; return rank -> offset."""
        offsets = {}
        for r in self.ranks.values():
            if r.identity is not None and r.stack_file is not None and r.rank not in skip:
                try:
                    offsets[r.rank] = r.stack_file.stat().st_size
                    os.kill(r.pid, STACK_SIGNAL)
                except OSError:
                    offsets.pop(r.rank, None)
        return offsets

    def read_stacks(self, rank: int, offset: int) -> str:
        r = self.ranks[rank]
        if r.stack_file is None:
            return ""
        try:
            with open(r.stack_file, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""
