"""The monitor's socket: one ZeroMQ ROUTER for every local rank, in front of the liveness model.

A thin adapter. Frames are decoded (ft_agent.protocol), the sender is authenticated (a hello
with its own rank's token, for a rank the launcher spawned in this cycle), and each message
kind is one handler in a table that turns it into a call on ``Liveness`` or a record for the
supervisor. Any bytes are either a valid message or a counted protocol error: nothing a
peer sends can raise out of ``handle_frame``.

``MonitorView`` answers the launcher's questions about the ranks; ``Monitor`` adds the
socket and the dispatch. The launcher reaches the monitor only through these members
(nothing outside this module touches its ``Liveness`` or ``TimeoutBook``):

- setup and teardown: ``Monitor.for_job``, ``endpoint``, ``socket`` (to poll), ``close``;
- the cycle: ``start_cycle`` (with the cycle's callbacks: closed sections, device times,
  stop fences), ``rank_exited``, ``end_cycle``, ``diagnoses``;
- reading: ``drain``, ``handle_frame``;
- the watch loop's questions: ``woke``, ``behind``, ``next_deadline``, ``check``,
  ``training_since``, ``any_connected``, ``all_connected``, ``take_controls``;
- the hang response: ``silent_ranks``, ``local_rank``, ``agent_pid``, ``stack_file``;
- what the ranks reported: ``last_activity``, ``heartbeat_ages``, ``progress``,
  ``last_progress``, ``checkpoints``, ``protocol_errors``;
- the timeouts: ``timeouts_in_force``, ``describe_timeouts``.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from ft_agent import protocol
from ft_launcher.hang.liveness import HangVerdict, Liveness
from ft_launcher.hang.stacks import STACK_SIGNAL
from ft_launcher.hang.timeouts import (
    TIMEOUT_HEARTBEAT,
    TIMEOUT_INITIAL,
    TIMEOUT_OUT_OF_SECTION,
    TimeoutBook,
    load_state,
    parse_timeouts,
    save_state,
    section_kind,
)

if TYPE_CHECKING:
    from ft_launcher.config import FaultToleranceConfig

log = logging.getLogger("ft_launcher")

EventSink = Callable[..., Any]  # event(name, **fields): records one event
SectionClosed = Callable[[int, str, float], Any]  # (rank, section, seconds)
DeviceTime = Callable[[int, str, float], Any]  # (rank, section, device seconds)
# Answers a rank's stop fence: (rank, seconds stopped) -> (current, why).
FenceAnswer = Callable[[int, float], tuple[bool, str]]
MAX_EXAMPLES = 20  # unknown section names remembered (counted beyond that, not kept)
DRAIN_BUDGET = 10_000  # frames read per drain before the loop looks at signals again
# What a diagnosis may carry onto the record; anything else a peer adds is dropped.
DIAGNOSIS_FIELDS = ("state", "diagnostic", "iteration", "message", "exit_code", "fatal",
                    "host", "device", "suspicious_host", "suspicious_device")


@dataclass
class RankSlot:
    """A rank the launcher spawned this cycle, and its connection once it said hello."""

    rank: int
    local_rank: int
    pid: int  # the spawned process: the only pid signals go to, unless verified below
    token: str
    agent_pid: int | None = None  # the agent's process: the spawned one or a descendant
    identity: bytes | None = None
    stack_file: Path | None = None
    said_goodbye: bool = False


class MonitorView:
    """What the launcher asks about this cycle's ranks: their liveness, what they reported,
    the timeouts in force. Read-only; ``Monitor`` feeds it from the socket."""

    def __init__(self, book: TimeoutBook) -> None:
        self.book = book
        self.liveness = Liveness(book)
        self.slots: dict[int, RankSlot] = {}
        self.counters: dict[str, int] = {}
        self.unknown_sections: set[str] = set()

    def woke(self, planned: float, now: float) -> bool:
        """The launcher woke at ``now`` for a wake-up planned at ``planned``; True on a stall."""
        return self.liveness.woke(planned, now)

    def behind(self, seconds: float, now: float) -> bool:
        """The launcher was ``seconds`` behind reading its socket; True when that holds
        verdicts (see ``Liveness.behind``)."""
        return self.liveness.behind(seconds, now)

    def next_deadline(self) -> float | None:
        return self.liveness.next_deadline()

    def check(self, now: float) -> HangVerdict | None:
        return self.liveness.check(now)

    def training_since(self) -> float | None:
        """Wall time at which every rank was training (its first activity), or None."""
        since = self.liveness.training_since()
        return None if since is None else wall_of(since)

    def any_connected(self) -> bool:
        """Some rank of the cycle said hello (the script uses ft_agent)."""
        return any(s.identity is not None for s in self.slots.values())

    def closed_a_section(self, rank: int) -> bool:
        """The rank has closed a timed section this cycle (it times its work)."""
        r = self.liveness.ranks.get(rank)
        return r is not None and r.last_section_end is not None

    def all_connected(self) -> bool:
        """Every rank of the cycle said hello (so none waits for a reply)."""
        return all(s.identity is not None for s in self.slots.values())

    def goodbye_ranks(self) -> set[int]:
        """The ranks that said goodbye this cycle (and did not connect again)."""
        return {s.rank for s in self.slots.values() if s.said_goodbye}

    def protocol_errors(self) -> dict[str, Any]:
        """Counts of ignored messages per reason (and a few unknown section names)."""
        errors: dict[str, Any] = dict(self.counters)
        for reason, n in self.liveness.rejected.items():
            errors[reason] = errors.get(reason, 0) + n
        if self.unknown_sections:
            errors["unknown_section_names"] = sorted(self.unknown_sections)
        return errors

    def agent_pid(self, rank: int) -> int | None:
        """The process that runs the rank's agent, when it connected (verified pid)."""
        slot = self.slots.get(rank)
        return slot.agent_pid if slot is not None and slot.identity is not None else None

    def stack_file(self, rank: int) -> Path | None:
        slot = self.slots.get(rank)
        return slot.stack_file if slot is not None and slot.identity is not None else None

    def silent_ranks(self, verdict: HangVerdict, now: float) -> dict[int, float]:
        """The suspects of a hang: ``{rank: silence}`` (see ``Liveness.silent_ranks``)."""
        return self.liveness.silent_ranks(verdict, now)

    def local_rank(self, rank: int) -> int:
        return self.liveness.ranks[rank].local_rank

    def last_activity(self) -> dict[int, float]:
        """Each rank's latest known activity (monotonic)."""
        return {r.rank: r.floor() for r in list(self.liveness.ranks.values())}

    def heartbeat_ages(self, now: float | None = None) -> dict[int, float]:
        """Seconds since each rank's last activity (safe from the metrics' HTTP thread)."""
        now = time.monotonic() if now is None else now
        return {rank: round(now - at, 3) for rank, at in self.last_activity().items()}

    def progress(self) -> dict[int, int]:
        """Each rank's last reported step, for ranks that reported one."""
        return {r.rank: r.iteration for r in self.liveness.ranks.values()
                if r.iteration is not None}

    def last_progress(self) -> dict[int, tuple[int, float]]:
        """``{rank: (last step, when reported, monotonic)}``."""
        return {r.rank: (r.iteration, r.progress_at) for r in self.liveness.ranks.values()
                if r.iteration is not None and r.progress_at is not None}

    def checkpoints(self) -> list[int]:
        """The last checkpoint step each rank reported (ranks that reported one)."""
        return [r.checkpoint for r in self.liveness.ranks.values() if r.checkpoint is not None]

    def timeouts_in_force(self) -> dict[str, Any]:
        return self.book.in_force()

    def describe_timeouts(self) -> str:
        return self.book.describe()


class Monitor(MonitorView):
    """ROUTER socket, authentication and message dispatch for one node's ranks."""

    def __init__(self, endpoint: str, book: TimeoutBook, state_path: Path,
                 events: EventSink) -> None:
        super().__init__(book)
        self.endpoint = endpoint
        self.state_path = state_path
        self.events = events
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 100_000)
        self.socket.bind(endpoint)
        self.cycle = 0
        self.private_dir: Path | None = None
        self.by_identity: dict[bytes, RankSlot] = {}
        self.diagnoses: list[dict[str, Any]] = []
        self._controls: list[tuple[int, str]] = []
        # The cycle's callbacks, given to start_cycle. No fence answer: no rendezvous can
        # drop this node, so every rank's round is current.
        self._fence_answer: FenceAnswer | None = None
        self._on_device_time: DeviceTime | None = None
        self.report_handlers: dict[str, Callable[[int, str], None]] = {}  # what -> recorder
        self._handlers: dict[str, Callable[[RankSlot, dict[str, Any], float], None]] = {
            protocol.HEARTBEAT: self._on_heartbeat,
            protocol.SECTION_OPEN: self._on_section_open,
            protocol.SECTION_CLOSE: self._on_section_close,
            protocol.SECTION_CLOSE_ALL: self._on_section_close_all,
            protocol.PROGRESS: self._on_progress,
            protocol.CALCULATE: self._on_calculate,
            protocol.SET_TIMEOUTS: self._on_set_timeouts,
            protocol.CONTROL: self._on_control,
            protocol.DIAGNOSIS: self._on_diagnosis,
            protocol.REPORT: self._on_report,
            protocol.GOODBYE: self._on_goodbye,
            protocol.FENCE: self._on_fence,
        }

    @classmethod
    def for_job(cls, endpoint: str, ft: FaultToleranceConfig, state_path: Path,
                events: EventSink) -> Monitor:
        """The job's monitor, with the timeouts of ``ft`` and of the state file."""
        return cls(endpoint, TimeoutBook(ft, load_state(state_path)), state_path, events)

    # -- cycle lifecycle ---------------------------------------------------------------

    def start_cycle(self, cycle: int, slots: list[RankSlot], spawned_at: dict[int, float],
                    private_dir: Path, *, on_section_closed: SectionClosed | None = None,
                    on_device_time: DeviceTime | None = None,
                    on_fence: FenceAnswer | None = None) -> None:
        """Forget the previous cycle; clocks start at each worker's spawn (monotonic).

        The callbacks last for this cycle: every closed section (stragglers), a section's
        device time, and the answer to a rank's stop fence."""
        self.cycle = cycle
        self.liveness.on_section_closed = on_section_closed
        self._on_device_time = on_device_time
        self._fence_answer = on_fence
        self.private_dir = private_dir
        self.slots = {s.rank: s for s in slots}
        self.by_identity = {}
        self.diagnoses = []
        self._controls = []
        self.liveness.start_cycle({s.rank: (s.local_rank, spawned_at[s.rank]) for s in slots})

    def rank_exited(self, rank: int) -> None:
        self.liveness.goodbye(rank)

    def end_cycle(self) -> dict[int, dict[str, dict[str, float]]]:
        """Fold this cycle's intervals into the state file; return per-rank statistics."""
        self.book.observe(self.liveness.longest())
        save_state(self.state_path, self.book.state)
        for slot in self.slots.values():
            if slot.stack_file is not None:
                slot.stack_file.unlink(missing_ok=True)
        return self.liveness.stats()

    def close(self) -> None:
        self.socket.close(linger=0)

    # -- what the supervisor asks ------------------------------------------------------

    def drain(self, clock: Callable[[], float], budget: int = DRAIN_BUDGET) -> tuple[int, bool]:
        """Read queued frames, each at ``clock()`` as it is read: (frames read, queue empty)."""
        for handled in range(budget):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled, True
            except zmq.ZMQError as exc:  # e.g. out of file descriptors: keep running
                self._count("socket_error", str(exc))
                return handled, True
            if len(frames) != 2:
                self._count("malformed", f"{len(frames)} frames")
                continue
            self.handle_frame(frames[0], frames[1], clock())
        return budget, False

    def handle_frame(self, identity: bytes, frame: bytes, now: float) -> None:
        """Decode one frame and act on it; never raises (a bad frame is counted)."""
        try:
            msg = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            self._count("malformed", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the decoder must never end the job
            self._count("malformed", f"decoder failure {type(exc).__name__}")
            return
        try:
            self._dispatch(identity, msg, now)
        except Exception as exc:  # noqa: BLE001 - nor may a handler
            log.exception("cycle %d: monitor failed on a %r message", self.cycle, msg.get("k"))
            self._count("handler_error", type(exc).__name__)

    def take_controls(self) -> list[tuple[int, str]]:
        """Workload control requests received since the last call."""
        taken, self._controls = self._controls, []
        return taken

    # -- dispatch ----------------------------------------------------------------------

    def _dispatch(self, identity: bytes, msg: dict[str, Any], now: float) -> None:
        kind = msg["k"]
        if kind == protocol.HELLO:
            self._hello(identity, msg, now)
            return
        slot = self.by_identity.get(identity)
        if slot is None:
            self._count("unauthenticated", f"{kind} from a peer without a valid hello")
            return
        handler = self._handlers.get(kind)
        if handler is None:
            self._count("unexpected", f"{kind} is not a message a rank sends")
            return
        handler(slot, msg, now)

    def _on_heartbeat(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        self.liveness.heartbeat(slot.rank, msg.get("t"), now, msg.get("folds", False))

    def _on_section_open(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        name = msg["name"]
        # The straggler section is timed to compare ranks, with or without a timeout.
        if not self.book.knows_section(name) and name != self.book.cfg.straggler_section:
            self._unknown_section(name)
        self.liveness.section_open(slot.rank, name, msg.get("t"), now)

    def _on_section_close(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        if not self.liveness.section_close(slot.rank, msg["name"], msg.get("t"), now):
            self._count("close_unopened", f"end of section {msg['name']!r} never opened")
        # An earlier section's GPU time (validated by the decoder), for the stragglers.
        if "dev" in msg and self._on_device_time is not None:
            self._on_device_time(slot.rank, msg["name"], msg["dev"])

    def _on_section_close_all(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        self.liveness.section_close_all(slot.rank, msg.get("t"), now)

    def _on_progress(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        changed = self.liveness.progress(slot.rank, msg["it"], msg["ckpt"], msg.get("t"), now)
        if changed is None:
            return
        at = round(wall_of(changed.at), 6)  # read in a batch: the report's own time
        if changed.first_step:
            self.events("first_step", rank=slot.rank, iteration=msg["it"], at=at)
        if changed.checkpoint:
            self.events("checkpoint_saved", rank=slot.rank, iteration=msg["it"], at=at)

    def _on_calculate(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        ok, error = self._calculate(msg)
        self._reply(slot, protocol.ACK, req=msg["req"], ok=ok, error=error,
                    timeouts=self.book.in_force(),
                    calculated=self.book.calculated_kinds())

    def _on_set_timeouts(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        values, problems = parse_timeouts(msg["timeouts"])
        if problems:
            self._count("bad_timeouts", "; ".join(problems)[:200])
            self._reply(slot, protocol.ACK, req=msg["req"], ok=False,
                        error="refused: " + "; ".join(problems)[:500],
                        timeouts=self.book.in_force(),
                    calculated=self.book.calculated_kinds())
            return
        self.book.set_values(values)
        self._timeouts_changed("loaded")
        self._reply(slot, protocol.ACK, req=msg["req"], ok=True, error=None,
                    timeouts=self.book.in_force(),
                    calculated=self.book.calculated_kinds())

    def _on_control(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        action = msg["action"]
        if action not in protocol.CONTROL_ACTIONS:
            self._count("malformed", f"unknown control action {action[:40]!r}")
            return
        self._controls.append((slot.rank, action))
        self.events("workload_control", rank=slot.rank, action=action,
                    description=(msg.get("description") or "")[:500])

    def _on_diagnosis(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        # Only the diagnosis fields: a peer cannot forge event names, times or ranks.
        fields = {k: msg[k] for k in DIAGNOSIS_FIELDS if k in msg}
        record = {"rank": slot.rank, **fields}
        if len(self.diagnoses) < 1000:
            self.diagnoses.append(record)
        self.events("diagnosis", **record)

    def _on_report(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        recorder = self.report_handlers.get(msg["what"])  # e.g. snapshots: events of their own
        if recorder is not None:
            return recorder(slot.rank, msg["message"])
        self.events("rank_report", rank=slot.rank, what=msg["what"][:100],
                    message=msg["message"][:8000])
        if msg["what"] == "simulated_fault":
            self._agent_fault(slot, msg["message"])

    def _on_goodbye(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        slot.said_goodbye = True
        self.liveness.goodbye(slot.rank)
        self.events("rank_goodbye", rank=slot.rank)

    def _on_fence(self, slot: RankSlot, msg: dict[str, Any], now: float) -> None:
        current, why = (True, "") if self._fence_answer is None else \
            self._fence_answer(slot.rank, msg["stopped_s"])
        self._reply(slot, protocol.ACK, req=msg["req"], ok=bool(current),
                    error=None if current else str(why)[:1000])

    def _agent_fault(self, slot: RankSlot, message: str) -> None:
        # A fault the rank inflicts on itself (the Lightning callback) is recorded like one
        # the launcher delivers, so ft_report pairs it with its detection and restart.
        fields = parse_agent_fault(message)
        if fields is None:
            self._count("malformed", f"simulated_fault report {message[:80]!r}")
            return
        self.events("fault_injected", rank=slot.rank, pid=slot.pid, source="agent", **fields)

    # -- hello -------------------------------------------------------------------------

    def _hello(self, identity: bytes, msg: dict[str, Any], now: float) -> None:
        slot = self.slots.get(msg["rank"])
        error = None
        if slot is None or slot.local_rank != msg["local_rank"]:
            error = f"rank {msg['rank']} / local rank {msg['local_rank']} is not on this node"
        elif not hmac.compare_digest(msg["token"].encode(), slot.token.encode()):
            error = "wrong token for this rank"
        elif msg["cycle"] != self.cycle:
            error = f"stale cycle {msg['cycle']} (now {self.cycle})"
        elif slot.identity is not None and slot.identity != identity and not slot.said_goodbye:
            error = f"rank {slot.rank} is already connected"
        if error is not None:
            self._count("rejected_hello", error)
            self._send(identity, protocol.CONFIG, ok=False, error=error)
            return
        assert slot is not None
        if slot.identity is not None:
            self.by_identity.pop(slot.identity, None)
        slot.identity, slot.said_goodbye = identity, False
        slot.agent_pid = verified_pid(msg["pid"], slot.pid)
        self.by_identity[identity] = slot
        self.liveness.reconnect(slot.rank)  # a rank may say goodbye and connect again
        self.events("rank_connected", rank=slot.rank, pid=slot.pid, agent_pid=slot.agent_pid,
                    host=msg["host"][:255],
                    after_s=round(now - self.liveness.ranks[slot.rank].spawned_at, 3))
        self._reply(slot, protocol.CONFIG, ok=True, timeouts=self.book.in_force(),
                    calculated=self.book.calculated_kinds(), stack_signal=int(STACK_SIGNAL))

    # -- timeouts ----------------------------------------------------------------------

    def _calculate(self, msg: dict[str, Any]) -> tuple[bool, str | None]:
        ok, error = calculate(self.book, self.liveness.longest(), msg)
        if ok:
            self._timeouts_changed(msg["what"])
        return ok, error

    def _timeouts_changed(self, what: str) -> None:
        save_state(self.state_path, self.book.state)
        log.info("cycle %d: timeouts in force: %s", self.cycle, self.book.describe())
        self.events("timeouts_updated", what=what, timeouts=self.book.in_force(),
                    calculated=self.book.calculated_kinds())

    # -- internals ---------------------------------------------------------------------

    def _reply(self, slot: RankSlot, kind: str, **fields: Any) -> None:
        if slot.identity is not None:
            self._send(slot.identity, kind, **fields)

    def _send(self, identity: bytes, kind: str, **fields: Any) -> None:
        try:
            self.socket.send_multipart([identity, protocol.encode(kind, **fields)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("cycle %d: cannot reply %s: %s", self.cycle, kind, exc)

    def _unknown_section(self, name: str) -> None:
        if len(self.unknown_sections) < MAX_EXAMPLES:
            self.unknown_sections.add(name[:64])
        self._count("unknown_section", f"section {name[:64]!r} has no timeout")

    def _count(self, what: str, detail: str) -> None:
        n = self.counters.get(what, 0) + 1
        self.counters[what] = n
        if n == 1:  # logged once per reason, counted always; %r escapes control characters
            log.warning("cycle %d: monitor ignored a message (%s): %r", self.cycle, what,
                        detail[:200])


def calculate(book: TimeoutBook, longest: dict[str, float],
              msg: dict[str, Any]) -> tuple[bool, str | None]:
    """Carry out a rank's ``calculate`` request on ``book`` from this cycle's ``longest``
    intervals and the ones observed before: (done, why not)."""
    observed = book.state.observed

    def worst(kind: str) -> float | None:
        values = [v for v in (longest.get(kind), observed.get(kind)) if v is not None]
        return max(values) if values else None

    what = msg["what"]
    if what == "hb":
        hb = worst(TIMEOUT_HEARTBEAT)
        if hb is None:
            return False, "no heartbeat interval observed yet"
        book.calculate(TIMEOUT_HEARTBEAT, hb)
        book.calculate(TIMEOUT_INITIAL, worst(TIMEOUT_INITIAL))
    elif what == "sections":
        names = {k.split(":", 1)[1] for k in longest if k.startswith("section:")}
        wanted = msg.get("sections")
        if isinstance(wanted, list):
            names &= {n for n in wanted if isinstance(n, str)}
        for name in sorted(names):
            book.calculate(section_kind(name), worst(section_kind(name)))
        if msg.get("out_of_section", True):
            book.calculate(TIMEOUT_OUT_OF_SECTION, worst(TIMEOUT_OUT_OF_SECTION))
    else:
        return False, f"unknown calculation {what[:40]!r}"
    return True, None


def parse_agent_fault(message: str) -> dict[str, Any] | None:
    """The fields of a rank's ``simulated_fault`` report, or None when malformed."""
    try:
        fault = json.loads(message)
        fields = {"fault_type": str(fault["fault_type"])[:40], "at": float(fault["at"])}
        if "code" in fault:
            fields["code"] = int(fault["code"])
        if "factor" in fault:  # a rank_slow the rank carries out (its sections)
            fields["factor"] = float(fault["factor"])
            duration = fault.get("duration")
            fields["duration"] = None if duration is None else float(duration)
            fields["by"] = "sections"
            if not all(math.isfinite(v) for v in (fields["factor"], duration or 0.0)):
                raise ValueError("factor or duration is not finite")
        if not math.isfinite(fields["at"]):
            raise ValueError("at is not finite")
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError):
        return None
    return fields


def verified_pid(claimed: Any, spawned: int) -> int:
    """The pid to signal for a rank's agent: the claimed one only when it is the spawned
    process or in its process group (a wrapper's child); the spawned one otherwise."""
    if not isinstance(claimed, int) or claimed <= 0 or claimed == spawned:
        return spawned
    try:
        if os.getpgid(claimed) == spawned:  # each worker leads its own process group
            return claimed
    except OSError:
        pass
    return spawned


def wall_of(monotonic: float) -> float:
    """A time of the node's monotonic clock on the wall clock."""
    return time.time() - (time.monotonic() - monotonic)


def monotonic_of(wall: float) -> float:
    """A wall-clock time on the monotonic clock (workers record their spawn on the wall)."""
    return time.monotonic() - (time.time() - wall)
