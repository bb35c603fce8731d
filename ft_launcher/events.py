"""The one table of event names the launcher writes to ``events.jsonl``.

Every record carries ``ts``, ``event`` and ``cycle``; the fields listed here come on top.
``docs/reference/events.md`` is generated from this table (``python -m scripts.docs.render``),
and ``tests/test_docs.py`` fails when the launcher emits a name that is not here or the table
names one the launcher never emits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventDoc:
    """What one event means, the area it belongs to and the fields it carries."""

    area: str
    meaning: str
    fields: str = ""


EVENTS: dict[str, EventDoc] = {
    # -- the launcher's life ------------------------------------------------------------
    "launcher_started": EventDoc(
        "launcher", "the launcher started (a reused run directory is a new attempt)",
        "host, pid, nproc_per_node, max_restarts, entrypoint, timeouts, straggler_section, "
        "attempt"),
    "launcher_exited": EventDoc("launcher", "the launcher is about to exit", "exit_code, reason"),
    "launcher_stalled": EventDoc(
        "launcher", "the launcher itself woke late or read a long backlog; verdicts wait",
        "late_s, cause"),
    "health_check_failed": EventDoc(
        "launcher", "a node health check failed before the rendezvous; the node does not join",
        "check, exit_code, output, duration_s"),
    "signal_received": EventDoc("signals", "the launcher received a signal", "signal"),
    "signal_forwarded": EventDoc(
        "signals", "a signal was passed on to the ranks that have a handler for it",
        "signal, ranks, waiting"),
    "signal_held": EventDoc(
        "signals", "a signal is held until each rank installs its handler",
        "signal, ranks, reason"),
    # -- one cycle ----------------------------------------------------------------------
    "rendezvous_done": EventDoc(
        "cycle", "this node has its place in a world",
        "group_rank, round, group_world_size, world_size, master_addr, master_port, left "
        "(nodes of this node's previous round missing from this one)"),
    "workers_started": EventDoc(
        "cycle", "the cycle's workers were started", "ranks, pids, device_map, warm"),
    "rank_connected": EventDoc(
        "cycle", "a rank's ft_agent said hello with its token",
        "rank, pid, agent_pid, host, after_s"),
    "training_started": EventDoc(
        "cycle", "every rank is active (first heartbeat, section or progress report)", "at"),
    "first_step": EventDoc(
        "cycle", "a rank reported its first step (report_progress)", "rank, iteration, at"),
    "checkpoint_saved": EventDoc(
        "cycle", "a rank reported a checkpoint (report_checkpoint)", "rank, iteration, at"),
    "last_progress": EventDoc(
        "cycle", "a rank's last reported step, recorded when the cycle ends",
        "rank, iteration, at"),
    "interval_stats": EventDoc(
        "cycle", "per rank and interval kind: count and min / median / p99 / max",
        "rank, kind, and the statistics"),
    "timeouts_updated": EventDoc(
        "cycle", "timeouts in force changed (calculated, loaded or learned)",
        "what, timeouts, calculated"),
    "rank_report": EventDoc(
        "cycle", "a rank sent a report (for instance an exception before it dies)",
        "rank, what, message"),
    "rank_goodbye": EventDoc("cycle", "a rank shut its monitoring down cleanly", "rank"),
    "exit_stuck": EventDoc(
        "cycle", "ranks said goodbye after a peer exited cleanly or a rank announced its "
        "exit 16/17, but did not exit within waited_s; their stacks were dumped, they were "
        "killed and the cycle succeeded (a clean exit) or ended as announced",
        "ranks, waited_s"),
    "workload_control": EventDoc(
        "cycle", "a rank asked the launcher to continue, exclude its node or shut down",
        "rank, action, description"),
    "diagnosis": EventDoc(
        "cycle", "a rerun state machine result or verdict forwarded by the rank",
        "rank and the diagnosis' fields"),
    "output_dropped": EventDoc(
        "cycle", "worker output could not be written (a full disk); bytes counted",
        "rank, log, reason"),
    "worker_exited": EventDoc(
        "cycle", "a worker exited",
        "rank, local_rank, pid, exit_code, signal, warm, stopped_by_launcher, "
        "output_dropped_bytes"),
    "decision": EventDoc(
        "cycle", "the policy's decision at the end of a cycle",
        "outcome, restart, exit_code, reason"),
    "restart": EventDoc("cycle", "the group is restarted", "restarts, reason, device_map"),
    # -- faults and hangs ---------------------------------------------------------------
    "fault_injected": EventDoc(
        "faults", "a simulated fault was carried out",
        "rank, fault_type, pid, at, delay, counted_from (spawn or training; source for a "
        "fault carried out by ft_agent), factor, duration, max_stop_s (rank_slow: the "
        "throttle's longest stop)"),
    "fault_not_fired": EventDoc(
        "faults", "a cycle ended (and with it, for the last one, the job) with its armed "
        "simulated fault never fired",
        "fault_type, rank, delay, counted_from (spawn, training or connection), waited_s "
        "(how long that clock ran before the cycle ended; null when it never started), "
        "cycle_s (from the spawn to the cycle's end)"),
    "hang_detected": EventDoc(
        "faults", "a rank was judged hung",
        "rank, timeout_kind, timeout_s, silence_s, expired_rank, expired_silence_s, "
        "detected_at, blame, suspects, host"),
    "peer_verdict": EventDoc(
        "faults", "another node's hang verdict reached this node: its ranks' stacks are "
        "dumped, none of them is killed, and the cycle ends for a new round",
        "rank, node, host, group_rank, blame, timeout_kind, silence_s"),
    "stacks_dumped": EventDoc(
        "faults", "stacks of the node's ranks were written to stacks/", "ranks, missing"),
    "nccl_traces_collected": EventDoc(
        "faults", "NCCL flight-recorder dumps were filed in stacks/", "ranks, asked, missing"),
    "rank_killed": EventDoc(
        "faults", "the launcher sent the termination signal to a rank",
        "rank, pid, signal, reason, peers_answered (several nodes: how many other nodes "
        "dumped their stacks first)"),
    # -- stragglers ---------------------------------------------------------------------
    "straggler_detected": EventDoc(
        "stragglers", "a rank is persistently slower than the others in the timed section",
        "rank, host, section, score, window, median_s, reference_s, steps, clock"),
    "straggler_cleared": EventDoc(
        "stragglers", "a reported straggler is back to the others' pace",
        "rank, host, section, score, window, median_s, reference_s, steps, clock"),
    # -- several nodes ------------------------------------------------------------------
    "spare_waiting": EventDoc(
        "nodes", "the round was full: this launcher waits as a hot spare",
        "round, participants, max_nodes"),
    "spare_admitted": EventDoc(
        "nodes", "a waiting spare was admitted to a new round",
        "waited_s, round, group_rank, group_world_size"),
    "peers_waiting": EventDoc(
        "nodes", "other nodes wait in the rendezvous or were lost: this node restarts",
        "waiting, lost, why (why the next round opened)"),
    "node_dropped": EventDoc(
        "nodes", "this node found itself dropped from its round (after a stall); it re-joins",
        "round, reason, why (keep-alive lapsed: the coordinator dropped it; fenced: it "
        "counted itself out), node, last_seen_s (its last keep-alive, on the observer's "
        "clock), frozen_s, next"),
    "stop_fence": EventDoc(
        "nodes", "a rank thawed after a long stop asked whether its round is still current",
        "rank, stopped_s, current, reason"),
    # -- snapshots ----------------------------------------------------------------------
    "snapshots_ready": EventDoc(
        "snapshots", "snapshots are ready at the first cycle: a stale directory of this job "
        "removed; the first rank to snapshot makes the directory",
        "path, every, overhead, memory, rank_memory, replicas, stale_removed"),
    "snapshots_off": EventDoc(
        "snapshots", "the snapshot directory was refused or could not be made: the job runs "
        "without snapshots", "reason, path"),
    "snapshot_picked": EventDoc(
        "snapshots", "at a cycle start: the iteration every rank restores (null: none, and "
        "why), after checking each copy of it in full",
        "iteration, reason, ranks (iterations held per rank), verified_bytes, seconds, "
        "discarded ([rank, slot, iteration] of copies uncommitted)"),
    "snapshot_restored": EventDoc(
        "snapshots", "a rank loaded its snapshot (restore())",
        "rank, iteration, source (local, replica), bytes, seconds"),
    "snapshot_skipped": EventDoc(
        "snapshots", "a rank's snapshot was not taken",
        "rank, iteration, reason (budget, busy, claim, held, io, unsupported), bytes, count "
        "(since the last such event)"),
    "snapshot_frequency": EventDoc(
        "snapshots", "the default frequency the ranks agreed on, or a change of it: every "
        "`every` steps from iteration `start`, and why (the rank whose snapshots cost the most "
        "for its step time)",
        "every, start, previous, reason (first measure, over budget, cheaper, new cycle), "
        "rank, blocking_s, commit_s, commit_counted (no idle core), step_s, budget, overhead "
        "(expected share of the step time), ranks_measured"),
    "snapshot_rejected": EventDoc(
        "snapshots", "a copy failed its checks (checksum, size, format, NaN); never loaded",
        "rank, iteration, slot, reason, by (launcher, rank)"),
    "snapshot_world_timeout": EventDoc(
        "snapshots", "several nodes: a node did not publish its snapshot holdings (or its "
        "verdict) within the bounded wait; no rank restores this cycle",
        "round, phase (holds, verdict), missing (group ranks), waited_s"),
    "snapshot_replicated": EventDoc(
        "snapshots", "a local rank's newest snapshot was pushed to a buddy node",
        "rank, iteration, endpoint, bytes, seconds, skipped (the buddy already held it)"),
    "snapshot_replica_fetched": EventDoc(
        "snapshots", "at a cycle start: a rank's snapshot was fetched from another node's "
        "replica", "rank, iteration, endpoint, bytes, seconds"),
    "snapshot_replica_failed": EventDoc(
        "snapshots", "a replica push, fetch or the replica server failed (the job goes on)",
        "rank, op (push, fetch, serve), endpoint, iteration, reason"),
    # -- warm restart -------------------------------------------------------------------
    "zygote_ready": EventDoc(
        "warm restart", "the zygote imported the preloads",
        "pid, preload, import_s, threads, ready_s, memory"),
    "zygote_fallback": EventDoc(
        "warm restart", "forking is not safe: standbys are spawned instead", "reason, preload"),
    "standby_ready": EventDoc(
        "warm restart", "a standby for a local rank is ready",
        "local_rank, pid, preload, generation (learners that took over before its fork), "
        "forked, import_s, ready_s, threads, memory"),
    "preload_learned": EventDoc(
        "warm restart", "the zygote imported modules the job's warm workers imported; "
        "standbys forked before are replaced",
        "modules (their packages), count, imported, import_s, cpu_s, pid (the new zygote), "
        "warmed (the compiler's first-use work the new zygote did: torch_key, vector_isas), "
        "from_state (learned by an earlier job), memory"),
    "preload_refused": EventDoc(
        "warm restart", "a module the workers imported is left out of the preloads for "
        "the job", "module, reason"),
    "standby_died": EventDoc(
        "warm restart", "a standby died before it was used",
        "local_rank, pid, forked, was_ready, exit_code, signal"),
    "standbys_not_ready": EventDoc(
        "warm restart", "the first cycle waited its limit for the zygote's forks: ranks "
        "without a ready standby start cold", "waited_s"),
    "store_taken": EventDoc(
        "warm restart", "the cycle's TCPStore, hosted by a fork of the zygote, was taken",
        "port, pid"),
    "warm_restart_disabled": EventDoc(
        "warm restart", "warm restart is off for this job (a preload failed, --no-python, ...)",
        "reason"),
}
