"""RankMonitorClient: the training process's line to the launcher's monitor.

Method names follow NVRx's ``RankMonitorClient`` so code ports by changing an import.
Without ``FT_ENDPOINT`` in the environment (plain ``python train.py`` or plain torchrun)
every call is a cheap no-op after one warning.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Collection, Mapping
from typing import IO, Any

from ft_agent import nvrx_types, protocol, simulated_fault, stop_fence
from ft_agent.device_time import DeviceTimer
from ft_agent.link import REQUEST_TIMEOUT_S, MonitorLink, ask_fence
from ft_agent.nvrx_types import (
    CalculatedMarks,
    HeartbeatTimeouts,
    SectionTimeouts,
    StateDictError,
    WorkloadAction,
    WorkloadControlRequest,
)
from ft_agent.snapshot_client import SnapshotMixin

log = logging.getLogger("ft_agent")

SHUTDOWN_LINGER_MS = 2000
# A fire-and-forget report needs a moment on ZeroMQ's I/O thread before the process exits.
REPORT_FLUSH_S = 0.2
# Section names whose frames are kept; a training inventing names without end (an f-string
# with the step in it) still works beyond this, on frames built per call.
MAX_SECTION_NAMES = 4096


class RankMonitorClientError(RuntimeError):
    """The monitor refused this rank or did not answer a request."""


class RankMonitorClient(SnapshotMixin):
    """Heartbeats, sections, timeout calculation and reports for one rank.

    Not thread-safe for concurrent use from several threads without the internal lock;
    every public method takes the lock, and a heartbeat never blocks on the network.

    As in NVRx, ``hb_timeouts`` and ``section_timeouts`` tell which timeouts are in force
    (as the monitor last reported them), and ``state_dict()`` holds the calculated ones in
    NVRx's checkpoint layout (``CURRENT_TIMEOUTS_STATE_KEY``).
    """

    CURRENT_TIMEOUTS_STATE_KEY = nvrx_types.CURRENT_TIMEOUTS_STATE_KEY

    def __init__(self) -> None:
        self._link: Any = None  # a MonitorLink while connected
        self._enabled = False
        self._warned = False
        self._stack_file: IO[str] | None = None
        self.timeouts: dict[str, Any] = {}  # as the monitor last reported them
        self._marks = CalculatedMarks()  # which of them this client calculated or loaded
        self._pending_state: dict[str, Any] | None = None  # loaded before init
        self._device: DeviceTimer | None = None  # created by the first device section
        self.rank = int(os.environ.get("RANK", "0"))
        self.cycle = int(os.environ.get("FT_CYCLE", "0"))
        self._sections = _SectionFrameCache(self.rank)  # name -> frames
        self._stop_fence: stop_fence.StopFence | None = None  # FT_STOP_FENCE_S
        # Heartbeats closer than this to the last one sent are folded into it (0: never).
        self.heartbeat_fold_s = protocol.HEARTBEAT_FOLD_S
        self._hb_sent_at = -math.inf
        self._hb_folds = False
        self._exit_pid: int | None = None  # the process whose exit says goodbye

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        """True when connected to a launcher's monitor."""
        return self._enabled

    @property
    def hb_timeouts(self) -> HeartbeatTimeouts:
        """The heartbeat timeouts in force (NVRx's ``hb_timeouts``); not valid until both
        are set, calculated or learned."""
        return nvrx_types.heartbeat_timeouts(self.timeouts, self._marks)

    @property
    def section_timeouts(self) -> SectionTimeouts:
        """The section and out-of-section timeouts in force (NVRx's ``section_timeouts``)."""
        return nvrx_types.section_timeouts(self.timeouts, self._marks)

    def init_workload_monitoring(self, num_warmup_iters: int | None = None) -> None:
        """Connect to the monitor named by ``FT_ENDPOINT`` and say hello; a state loaded
        before this call is put in force now.

        Raises RankMonitorClientError when the monitor refuses the token or does not
        answer; does nothing (after one warning) outside ``ft_launcher``.
        ``num_warmup_iters`` is accepted for NVRx code and has no effect: timeouts apply
        from the first step here.
        """
        if self._enabled:
            return
        endpoint = os.environ.get("FT_ENDPOINT")
        if not endpoint:
            self._warn_disabled()
            return
        self._link = MonitorLink.connect(endpoint, self.rank)
        reply = self._link.hello(_hello_frame(self.rank, self.cycle))
        refusal = _hello_refusal(reply, endpoint)
        if refusal is not None:
            self._close()
            raise RankMonitorClientError(refusal)
        assert reply is not None
        self._absorb(reply)
        self._stack_file = _register_stack_dump(reply, self.rank)
        self._enabled = True
        if self._pending_state is not None:
            self._set_timeouts(self._pending_state)
            self._pending_state = None
        _arm_simulated_faults(self, os.environ.get("FT_SIMULATED_FAULT", ""))
        self._arm_stop_fence()
        if self._exit_pid is None:
            self._exit_pid = os.getpid()
            atexit.register(self._goodbye_at_exit)
        log.debug("rank %d cycle %d: connected to %s", self.rank, self.cycle, endpoint)

    def shutdown_workload_monitoring(self) -> None:
        """Say goodbye and close the connection; the monitor stops judging this rank."""
        if not self._enabled:
            return
        self._link.send(protocol.encode(protocol.GOODBYE))
        # Queued messages (a diagnosis just before an exit 16/17) are delivered first, for
        # at most this long when the monitor is gone.
        self._close(linger_ms=SHUTDOWN_LINGER_MS)

    def _goodbye_at_exit(self) -> None:
        # A script that never shut monitoring down says goodbye when its interpreter exits:
        # training is over, and if the teardown that follows (finalising torch, a process
        # group's threads) never ends, the launcher ends this rank once a peer has exited
        # cleanly (ft_launcher/hang/exit_watch.py) instead of waiting for ever. Not in a
        # forked child (its atexit handlers may run, and the connection is the parent's).
        if os.getpid() == self._exit_pid:
            self.shutdown_workload_monitoring()

    # -- hot path ----------------------------------------------------------------------

    def send_heartbeat(self) -> None:
        """Tell the monitor this rank is alive. Never blocks, never raises."""
        if not self._enabled:
            return
        t = time.monotonic()
        if t - self._hb_sent_at < self.heartbeat_fold_s:
            if self._hb_folds:
                return  # folded into the last one sent (protocol.HEARTBEAT_FOLD_S)
            self._hb_folds = True  # said in this heartbeat, before the first fold
        self._hb_sent_at = t
        self._link.send(protocol.heartbeat_frame(t, self._hb_folds))

    def start_section(self, name: str, device: bool = False) -> None:
        """Open a timed section (its own timeout applies while it is open). Never blocks.

        ``device=True`` also times the section on the GPU (CUDA events on the current
        stream, never synchronised); pass it to ``end_section`` too.
        """
        if not self._enabled:
            return
        frames = self._sections.get(name) or self._sections.frames(name)
        if frames is None:
            return
        if device:
            self._device_timer().open(frames.name)
        self._link.send(frames.open(time.monotonic()))

    def end_section(self, name: str, device: bool = False) -> None:
        """Close a timed section opened with start_section. Never blocks.

        With ``device=True`` the close carries the device time of the oldest earlier
        section of this name whose events have completed (see ft_agent.device_time).
        """
        if not self._enabled:
            return
        t = time.monotonic()  # before the event bookkeeping: the section ends now
        frames = self._sections.get(name) or self._sections.frames(name)
        if frames is None:
            return
        device_s = self._device_timer().close(frames.name) if device else None
        self._link.send(frames.close(t, device_s))

    def end_all_sections(self) -> None:
        """Close every open section of this rank."""
        self._fire(protocol.SECTION_CLOSE_ALL, t=time.monotonic())

    def section(self, name: str, device: bool = False) -> _Section:
        """``with client.section("step"): ...`` opens and closes a timed section;
        ``device=True`` times it on the GPU too (see start_section)."""
        return _Section(self, name, device)

    def _device_timer(self) -> DeviceTimer:
        if self._device is None:
            self._device = DeviceTimer()
        return self._device

    def report_progress(self, iteration: int) -> None:
        """Tell the launcher the training finished step ``iteration``. Never blocks.

        The launcher's goodput ledger counts work from these reports; a heartbeat is implied.
        """
        self._fire(protocol.PROGRESS, it=int(iteration), ckpt=False, t=time.monotonic())

    def report_checkpoint(self, iteration: int) -> None:
        """Tell the launcher a checkpoint of step ``iteration`` was saved. Never blocks."""
        self._fire(protocol.PROGRESS, it=int(iteration), ckpt=True, t=time.monotonic())

    # -- timeouts ----------------------------------------------------------------------

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Have the monitor compute heartbeat timeouts from the intervals it observed.

        The monitor measures every interval itself, so no collective call is needed and a
        missing rank cannot deadlock this. Returns True when new timeouts are in force. As
        in NVRx, too few observed intervals raise RankMonitorClientError unless
        ``skip_if_not_ready``, which returns False. Outside ft_launcher: False.
        """
        reply = self._request_reply(protocol.CALCULATE, what="hb",
                                    skip_if_not_ready=skip_if_not_ready)
        if reply is None:
            return False
        if not reply["ok"]:
            return _not_ready(reply, skip_if_not_ready)
        self._marks.heartbeat = True
        return True

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: Collection[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Have the monitor compute section timeouts from the section times it observed
        (only ``selected_sections`` when given; the out-of-section one too when
        ``calc_out_of_section``). Returns True when they are in force."""
        wanted = None if selected_sections is None else [str(n) for n in selected_sections]
        reply = self._request_reply(protocol.CALCULATE, what="sections", sections=wanted,
                                    out_of_section=calc_out_of_section)
        if reply is None:
            return False
        if not reply["ok"]:
            return _not_ready(reply, skip_if_not_ready)
        nvrx_types.mark_sections_calculated(self._marks, self.section_timeouts, wanted,
                                            calc_out_of_section)
        return True

    def state_dict(self) -> dict[str, Any]:
        """The calculated timeouts in force, for a checkpoint, in NVRx's layout
        (``{"current_timeouts": {"heartbeat": ..., "section": ...}}``; JSON-serialisable)."""
        return nvrx_types.state_dict_of(self.hb_timeouts, self.section_timeouts)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put calculated timeouts from a checkpoint back in force (a state saved by NVRx's
        client or by this one). May be called before ``init_workload_monitoring``; they are
        put in force when it connects. Raises ValueError saying what is wrong."""
        try:
            timeouts, marks = nvrx_types.timeouts_from_state(state)
        except StateDictError as exc:
            raise ValueError(str(exc)) from None
        self._marks = marks
        if not self._enabled:
            self._pending_state = timeouts
            return
        self._set_timeouts(timeouts)

    def _set_timeouts(self, timeouts: dict[str, Any]) -> None:
        if timeouts:
            self._request_reply(protocol.SET_TIMEOUTS, timeouts=timeouts)

    # -- control and reports -----------------------------------------------------------

    def send_workload_control_request(
        self, req: WorkloadControlRequest | WorkloadAction | str
    ) -> None:
        """Ask the launcher to go on, exclude this node or shut the job down: NVRx's
        ``WorkloadControlRequest(WorkloadAction.ExcludeThisNode, "why")``, a
        ``WorkloadAction``, or "continue" / "exclude_node" / "shutdown"."""
        self._fire(protocol.CONTROL, **_control_fields(req))

    def send_diagnosis(self, **fields: Any) -> None:
        """Forward a rerun state machine event (state, diagnostic, iteration, ...)."""
        fields.setdefault("iteration", None)
        fields.setdefault("state", "UNKNOWN")
        self._fire(protocol.DIAGNOSIS, **fields)

    def send_report(self, what: str, message: str) -> None:
        """Put something this rank observed on the launcher's record (e.g. an exception)."""
        self._fire(protocol.REPORT, what=str(what), message=str(message)[:8000])

    # -- internals ---------------------------------------------------------------------

    def _warn_disabled(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn("ft_agent: FT_ENDPOINT is not set (not started by ft_launcher); "
                          "fault-tolerance calls do nothing", RuntimeWarning, stacklevel=3)

    def _fire(self, kind: str, **fields: Any) -> None:
        if not self._enabled:
            return
        try:
            frame = protocol.encode(kind, **fields)
        except protocol.ProtocolError as exc:  # e.g. a NaN: never the training's problem
            log.warning("rank %d: not sent (%s): %s", self.rank, kind, exc)
            return
        self._link.send(frame)

    def _request_reply(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """Send a request and wait for its ack; None when not connected or no answer."""
        if not self._enabled:
            return None
        reply = self._link.request(kind, **fields)
        if reply is None:
            log.warning("rank %d: monitor did not answer %s request", self.rank, kind)
            return None
        self._absorb(reply)
        if not reply["ok"] and reply.get("error"):
            log.warning("rank %d: %s: %s", self.rank, kind, reply["error"])
        return reply

    def _absorb(self, reply: dict[str, Any]) -> None:
        """Take the timeouts in force from a config reply or an ack; when the monitor says
        which of them are calculated (``calculated``: kinds such as "heartbeat",
        "section:step"), that is what ``hb_timeouts``/``section_timeouts`` report."""
        self.timeouts, self._marks = nvrx_types.absorb_reply(reply, self.timeouts, self._marks)

    def _arm_stop_fence(self) -> None:
        # After a long stop of its node, this rank asks whether its round is still current
        # before it writes anything (see ft_agent.stop_fence); only where the launcher asks.
        threshold = stop_fence.threshold_from_env(os.environ)
        if threshold is not None and self._stop_fence is None:
            fence = stop_fence.StopFence(threshold, self._ask_fence)
            self._stop_fence = fence if fence.install() else None

    def _ask_fence(self, stopped_s: float) -> tuple[bool | None, str]:
        """The launcher's word after a stop (``link.ask_fence``)."""
        if not self._enabled:
            return True, "not monitored any more"
        return ask_fence(self._link, stopped_s)

    def _close(self, linger_ms: int = 0) -> None:
        self._enabled = False
        if self._stop_fence is not None:
            self._stop_fence.close()
            self._stop_fence = None
        if self._link is not None:
            self._link.close(linger_ms)
            self._link = None


def _not_ready(reply: dict[str, Any], skip_if_not_ready: bool) -> bool:
    """A calculation the monitor could not do yet: False, or (as in NVRx) raise."""
    if skip_if_not_ready:
        return False
    raise RankMonitorClientError(f"timeouts not calculated: {reply.get('error')}")


def _hello_frame(rank: int, cycle: int) -> bytes:
    return protocol.encode(protocol.HELLO, token=os.environ.get("FT_TOKEN", ""), rank=rank,
                           # FT_LOCAL_RANK: the real one under --virtual-local-rank (LOCAL_RANK=0)
                           local_rank=int(os.environ.get("FT_LOCAL_RANK")
                                          or os.environ.get("LOCAL_RANK", "0")),
                           pid=os.getpid(), host=socket.gethostname(), cycle=cycle)


def _hello_refusal(reply: dict[str, Any] | None, endpoint: str) -> str | None:
    """Why the hello failed (no answer, refused), or None: connected."""
    if reply is None:
        return f"monitor at {endpoint} did not answer hello within {REQUEST_TIMEOUT_S:.0f} s"
    if not reply["ok"]:
        return f"monitor refused this rank: {reply.get('error')}"
    return None


class _SectionFrameCache(dict):
    """Section name -> its pre-encoded frames (built on first use); None for a name the
    monitor would reject (warned once). A dict, so the hot path's lookup is one ``get``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def frames(self, name: str) -> protocol.SectionFrames | None:
        if name in self:
            return self[name]
        frames = None
        try:
            frames = protocol.section_frames(str(name))
        except protocol.ProtocolError as exc:
            log.warning("rank %d: section not sent: %s", self.rank, exc)
        if len(self) < MAX_SECTION_NAMES:
            self[name] = frames
        return frames


def _register_stack_dump(reply: dict[str, Any], rank: int) -> IO[str] | None:
    """Arm faulthandler on the signal the monitor names; the file it writes to (held for
    the process's life), or None.

    faulthandler writes from C, so it works while the rank is stuck inside a collective or
    a C extension, where a Python signal handler would never run. The file is the one the
    launcher named in this process's environment, never a path from the socket, and a
    symlink there is refused (O_NOFOLLOW)."""
    path, signum = os.environ.get("FT_STACK_FILE"), reply.get("stack_signal")
    if not path or not isinstance(signum, int) or isinstance(signum, bool):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        stack_file = os.fdopen(fd, "w")
        faulthandler.register(signum, file=stack_file, all_threads=True)
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("rank %d: cannot arm stack dumps: %s", rank, exc)
        return None
    return stack_file


def _control_fields(req: WorkloadControlRequest | WorkloadAction | str) -> dict[str, Any]:
    """The ``control`` message's fields for a workload control request; ValueError when
    it names no known action."""
    description = None
    if isinstance(req, WorkloadControlRequest):
        req, description = req.action, req.description
    action = req.wire if isinstance(req, WorkloadAction) else req
    if action not in protocol.CONTROL_ACTIONS:
        raise ValueError(
            f"workload control action {action!r}: expected a WorkloadControlRequest, a "
            f"WorkloadAction or one of {protocol.CONTROL_ACTIONS}"
        )
    return {"action": action,
            **({} if description is None else {"description": str(description)[:1000]})}


def _arm_simulated_faults(client: RankMonitorClient, spec: str) -> None:
    """The fault the launcher armed in ``FT_SIMULATED_FAULT``: ``rank_exit`` or
    ``rank_slow`` (the others are delivered from outside)."""
    _arm_simulated_exit(spec, client.send_report)
    _arm_simulated_slow(client, spec)


def _arm_simulated_exit(spec: str, report: Any) -> None:
    """``rank_exit:code=N,delay=D`` from the launcher: exit with N, D seconds from now (the
    rank connecting to its monitor is when its training starts).

    Signals can kill or stop a process from outside but cannot choose its exit code, so
    this one simulated fault is carried out by the rank itself; ``report(what, message)``
    puts it on the launcher's record first, as ``fault_injected``.
    """
    if not spec:
        return
    parsed = simulated_fault.parse_exit_fault(spec)
    if parsed is None:
        if spec.startswith(simulated_fault.EXIT_FAULT):
            log.warning("ignoring malformed FT_SIMULATED_FAULT=%r", spec)
        return
    code, delay = parsed

    def fire() -> None:
        log.warning("simulated fault: rank exits with %d", code)
        report("simulated_fault", json.dumps(
            {"fault_type": simulated_fault.EXIT_FAULT, "at": time.time(), "code": code}))
        time.sleep(REPORT_FLUSH_S)  # the I/O thread puts the report on the wire
        os._exit(code)

    timer = threading.Timer(delay, fire)
    timer.daemon = True
    timer.start()


def _arm_simulated_slow(client: RankMonitorClient, spec: str) -> None:
    """``rank_slow:factor=F,delay=D[,duration=S]`` from the launcher: from D seconds after
    the rank's first section, every timed section lasts F times its work (a sleep inside
    it, before it closes); the first one stretched is put on the launcher's record.

    A real straggler is slow in its work; a stop from outside lands anywhere in the step
    and leaves a short section's median untouched, so a rank that times sections slows
    them itself (the launcher then leaves it alone, ft_launcher/faults.py). Armed by
    wrapping this client's section calls: a client with no such fault runs unchanged.
    """
    if not spec.startswith(simulated_fault.SLOW_FAULT):
        return
    parsed = simulated_fault.parse_slow_fault(spec)
    if parsed is None:
        log.warning("ignoring malformed FT_SIMULATED_FAULT=%r", spec)
        return
    slow = simulated_fault.SlowSections(*parsed)
    start_section, end_section = client.start_section, client.end_section

    def start(name: str, device: bool = False) -> None:
        slow.opened(name, time.monotonic())
        start_section(name, device)

    def end(name: str, device: bool = False) -> None:
        extra = slow.extra_s(name, time.monotonic())
        if extra > 0:
            if not slow.reported:
                slow.reported = True
                client.send_report("simulated_fault", json.dumps(
                    {"fault_type": simulated_fault.SLOW_FAULT, "at": time.time(),
                     "factor": slow.factor, "duration": slow.duration}))
            time.sleep(extra)
        end_section(name, device)  # stamps the section's end: after the sleep

    client.start_section, client.end_section = start, end  # type: ignore[method-assign]


class _Section:
    """The context manager of ``client.section`` (a plain class: a generator-based one
    costs about a microsecond more per step)."""

    __slots__ = ("_client", "_name", "_device")

    def __init__(self, client: RankMonitorClient, name: str, device: bool) -> None:
        self._client, self._name, self._device = client, name, device

    def __enter__(self) -> None:
        self._client.start_section(self._name, self._device)

    def __exit__(self, *exc: object) -> None:
        self._client.end_section(self._name, self._device)


_default_client: RankMonitorClient | None = None


def get_client() -> RankMonitorClient:
    """The process-wide client (created on first use, not connected)."""
    global _default_client
    if _default_client is None:
        _default_client = RankMonitorClient()
    return _default_client
