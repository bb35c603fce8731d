"""When the watch loop wakes next: a pure function of its deadlines and what it polls.

The loop sleeps in one poll on the monitor's socket and the signal wake-up fd. Worker
exits and signals wake it at once (SIGCHLD); messages wake it by themselves, but carry
their send time, so right after a read it may sleep on the signals alone for
``MESSAGE_BATCH_S`` and drain the next batch in one go. Every deadline (a rank's timeout,
the simulated fault, a service's next step such as the status line) ends the sleep in time.
"""

from __future__ import annotations

import time as _time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

MESSAGE_BATCH_S = 0.25
# With nothing to poll, the loop still wakes this often (each wake-up costs the launcher
# CPU; every wake-up it needs comes from a signal, a message or a deadline).
IDLE_WAKE_S = 1.0
# A flood of messages is read in bounded batches; verdicts wait for the queue to empty, but
# never longer than this (a flood cannot postpone a real hang for ever).
MAX_JUDGE_DELAY_S = 10.0


@dataclass(frozen=True)
class WakeInputs:
    """What decides the next wake-up. ``now``, ``deadline``, ``batch_until`` and
    ``services_due`` are on the monotonic clock; ``wall`` and ``fault_due`` on the wall
    clock."""

    now: float
    wall: float
    interval: float  # --monitor-interval
    polls: bool  # something must be polled every interval (see ``must_poll``)
    deadline: float | None = None  # the earliest rank deadline
    fault_due: float | None = None  # the simulated fault, not fired yet
    batch_until: float = 0.0  # messages wait until then (read in one batch)
    services_due: float | None = None  # the services' next timed step (CycleService.due)


@dataclass(frozen=True)
class Wake:
    """Sleep ``timeout`` seconds at most; on the signal fd alone when ``signals_only``."""

    timeout: float
    signals_only: bool


def must_poll(polls_peers: bool, services_poll: bool, owed: bool) -> bool:
    """Whether something must be polled every ``--monitor-interval``: other nodes (the
    rendezvous), a service (the straggler exchange), or a rank a SIGUSR1 is owed to (until
    it installs a handler). A service with timed steps says when instead (``services_due``)."""
    return polls_peers or services_poll or owed


def next_wake(w: WakeInputs) -> Wake:
    """The next wake-up: the earliest of the poll interval (or ``IDLE_WAKE_S``), the rank
    deadline, the services' next step and the fault; within a message batch, on signals
    only."""
    timeout = w.interval if w.polls else IDLE_WAKE_S
    if w.deadline is not None:
        timeout = min(timeout, w.deadline - w.now)
    if w.services_due is not None:
        timeout = min(timeout, w.services_due - w.now)
    if w.fault_due is not None:
        timeout = min(timeout, w.fault_due - w.wall)
    signals_only = w.now < w.batch_until
    if signals_only:
        timeout = min(timeout, w.batch_until - w.now)
    return Wake(max(0.0, timeout), signals_only)


@dataclass
class WatchState:
    """What one cycle's watch loop carries from one pass to the next."""

    spawned_at: float  # wall clock: the last worker's spawn
    next_peer_check: float  # monotonic
    batch_until: float = 0.0  # monotonic: messages wait until then
    queued_since: float | None = None  # monotonic: the socket last had more than a batch
    empty: bool = True  # the last read emptied the socket's queue
    training_at: float | None = None  # wall clock: every rank showed activity

    def note_queue(self, empty: bool, now: float) -> bool:
        """After a read: whether verdicts may be judged now (the queue is empty, or has
        been full for over ``MAX_JUDGE_DELAY_S``)."""
        self.queued_since = None if empty else (self.queued_since or now)
        return self.queued_since is None or now - self.queued_since > MAX_JUDGE_DELAY_S


class Clock:
    """The clocks the loop reads (a test passes a fake one)."""

    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)


Wait = Callable[[float, bool], Any]  # wait(timeout_s, signals_only)


def socket_wait(monitor_socket: Any, wake_fd: int) -> Wait:
    """The real sleep: one zmq poll on the monitor's socket and the signal wake-up fd."""
    everything, signals_only = zmq.Poller(), zmq.Poller()
    everything.register(monitor_socket, zmq.POLLIN)
    for poller in (everything, signals_only):
        poller.register(wake_fd, zmq.POLLIN)

    def wait(timeout: float, only_signals: bool) -> None:
        (signals_only if only_signals else everything).poll(timeout * 1000)
    return wait
