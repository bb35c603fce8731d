"""Ranks whose training is over but whose process does not exit.

A rank that said goodbye (it shut its monitoring down: training is over) has no collective
left to wait for once the cycle is known to be ending: a peer already exited cleanly, or a
rank announced its exit 16/17 in a diagnosis (the rerun state machine stops every rank).
When it is still alive ``grace_s`` later its teardown is stuck: a process group's
destructor, a thread joined at interpreter exit, a child it waits for. Left alone it would
hold the job (and its nodes) forever; the cycle instead dumps its stack, says so and ends
it: the job is done after a clean exit, and judged by the announced code otherwise.

The rule is pure: the cycle passes what it sees and the time.
"""

from __future__ import annotations

from dataclasses import dataclass

# --workers-exit-timeout's default: long enough for a real teardown (a checkpoint flushed
# after goodbye, a process group destroyed, an interpreter finalised: 1-2 s here), short
# against a job's lifetime.
EXIT_GRACE_S = 30.0


@dataclass
class ExitWatch:
    """Tracks since when every live rank has said goodbye in a cycle that is ending."""

    grace_s: float = EXIT_GRACE_S  # 0: never overdue (the launcher waits as long as it takes)
    since: float | None = None  # monotonic: when the wait began

    def overdue(self, now: float, ending: bool, alive: set[int],
                said_goodbye: set[int]) -> list[int]:
        """The live ranks to end now (sorted), or [] while none is overdue.

        ``ending``: some rank of the cycle exited with code 0 or announced its exit 16/17;
        ``alive``: the ranks still running; ``said_goodbye``: the ranks that said goodbye
        this cycle."""
        if self.grace_s <= 0 or not (ending and alive and alive <= said_goodbye):
            self.since = None
            return []
        if self.since is None:
            self.since = now
        return sorted(alive) if now - self.since >= self.grace_s else []

    def deadline(self) -> float | None:
        """When the wait that began ends (monotonic), None while there is none."""
        return None if self.since is None else self.since + self.grace_s
