"""The launcher's signal plumbing: handlers, the wake-up fd, pending and owed signals.

Handlers only record a signal (and wake the loop through the wake-up fd); the loop takes
them in its next pass. A terminating signal that arrives while the launcher is blocked
(the rendezvous) raises ``Interrupted`` instead. A pass-through signal (SIGUSR1) that a
rank cannot take yet (no handler installed) is *owed* to it until it can.
"""

from __future__ import annotations

import contextlib
import select
import signal
import socket
from collections.abc import Iterable, Iterator
from typing import Any

from ft_launcher.torchrun_compat import split_signals

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PASS_THROUGH_SIGNALS = (signal.SIGUSR1,)  # handed to the workers, the job goes on


class Interrupted(Exception):
    """A terminating signal arrived while the supervisor was blocked (rendezvous)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalBox:
    """Pending signals, owed pass-through signals and the fd that wakes the loop."""

    def __init__(self, handled: tuple[int, ...] | None = None) -> None:
        # --signals-to-handle (torchrun's option) replaces the defaults above
        self.stops, self.passed_on = (
            (FORWARDED_SIGNALS, PASS_THROUGH_SIGNALS) if handled is None
            else split_signals(handled))
        self.stop_names = {signal.Signals(s).name for s in self.stops}
        self.pending: list[int] = []
        # Pass-through signals not yet handed to these ranks of the cycle.
        self.owed: dict[int, set[int]] = {}
        self._blocking = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def install(self) -> None:
        """Handle the forwarded, pass-through and SIGCHLD signals; wake the loop on each."""
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for s in (*self.stops, *self.passed_on, signal.SIGCHLD):
            signal.signal(s, self.on_signal)

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        self.pending.append(signum)
        if self._blocking and signum in self.stops:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """While inside, a terminating signal raises ``Interrupted`` in the handler."""
        self._blocking = True
        try:
            yield
        finally:
            self._blocking = False

    def wake_fd(self) -> int:
        return self._wake_r.fileno()

    def poke(self) -> None:
        """Wake the loop from another thread (a standby's output pump read a message for
        it); never raises, and a full wake-up socket already means a wake-up is due."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (BlockingIOError) or closed: nothing more to do
            pass

    def drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less when a signal arrives."""
        select.select([self._wake_r], [], [], seconds)
        self.drain_wakeups()

    def take(self) -> list[int]:
        """The signals received since the last call, SIGCHLD left out (it only wakes)."""
        taken = [s for s in self.pending if s != signal.SIGCHLD]
        self.pending.clear()
        return taken

    def terminating(self) -> int | None:
        """A pending terminating signal, left pending; or None."""
        return next((s for s in self.pending if s in self.stops), None)

    def owe(self, signum: int, ranks: Iterable[int]) -> set[int]:
        """Owe ``signum`` to ``ranks`` too; returns every rank it is owed to now."""
        owed = self.owed.setdefault(signum, set())
        owed.update(ranks)
        return owed

    def any_owed(self) -> bool:
        return any(self.owed.values())

    def carry_over(self) -> None:
        """A new cycle started: a pass-through signal that some rank of the last cycle
        never got is owed to the new ranks (Slurm's time-limit warning still stands)."""
        self.pending.extend(signum for signum, ranks in self.owed.items() if ranks)
        self.owed.clear()
