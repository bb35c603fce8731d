"""In-memory snapshots wired through the launcher: the pure choice, the reports, the area,
the options, and the cycle-start service on real snapshot files (ft_agent's store).

End-to-end runs with a real launcher are in test_snapshots_e2e.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_agent import snapshot as store
from ft_agent.client import RankMonitorClient
from ft_agent.snapshot_client import Frequency, SnapshotAgent, settings_from_env
from ft_launcher.config import ConfigError, parse_ft_value
from ft_launcher.snapshots import reports
from ft_launcher.snapshots.area import (
    Area,
    AreaRefused,
    area_name,
    check_leftover,
    default_root,
)
from ft_launcher.snapshots.pick import Choice, Copy, choose, pick_iteration, to_discard
from ft_launcher.snapshots.service import JobSnapshots, SnapshotOptions

# -- pick ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("per_rank", "expected"), [
    ({}, None),
    ({0: [3, 4], 1: [3, 4]}, 4),
    ({0: [3, 4], 1: [2, 3]}, 3),
    ({0: [4], 1: [3]}, None),
    ({0: [5, 6], 1: []}, None),
    ({0: [7]}, 7),
    ({0: [1, 9], 1: [9, 1], 2: [1, 2]}, 1),
])
def test_pick_iteration_is_the_newest_every_rank_has(per_rank, expected):
    assert pick_iteration(per_rank) == expected


def copies(**per_rank: list[tuple[str, int]]) -> dict[int, list[Copy]]:
    return {int(r[1:]): [Copy(slot, it, seq, 10) for seq, (slot, it) in enumerate(cs)]
            for r, cs in per_rank.items()}


def test_choose_falls_back_when_a_copy_fails_its_check():
    held = copies(r0=[("a", 3), ("b", 4)], r1=[("a", 3), ("b", 4)])
    calls = []

    def verify(wanted):
        calls.append(sorted((r, c.iteration) for r, c in wanted))
        return {(r, c.slot): ("checksum: bad" if (r, c.iteration) == (1, 4) else None)
                for r, c in wanted}

    choice = choose(held, verify)
    assert choice.iteration == 3
    assert [(r, c.iteration, why) for r, c, why in choice.rejected] == [(1, 4, "checksum: bad")]
    assert calls == [[(0, 4), (1, 4)], [(0, 3), (1, 3)]]  # each candidate checked once
    discard = {(r, c.slot) for r, c in to_discard(held, choice)}
    assert discard == {(0, "b"), (1, "b")}  # newer than 3 on rank 0; rejected on rank 1


def test_choose_says_why_when_nothing_is_common():
    choice = choose(copies(r0=[("a", 3)], r1=[]), lambda wanted: {})
    assert choice.iteration is None and "rank(s) 1 have no snapshot" in choice.reason
    assert choose(copies(r0=[], r1=[]), lambda w: {}).reason == "no rank has a snapshot"
    assert to_discard(copies(r0=[("a", 3)], r1=[]), Choice(None, "")) == [(0, Copy("a", 3, 0, 10))]


# -- reports ------------------------------------------------------------------------------


def test_reports_decode_valid_ones():
    assert reports.decode(json.dumps({"kind": "restored", "iteration": 5, "source": "local",
                                      "bytes": 10, "seconds": 0.5, "event": "forged"})) == (
        "snapshot_restored", {"iteration": 5, "source": "local", "bytes": 10, "seconds": 0.5})
    assert reports.decode(json.dumps({"kind": "skipped", "iteration": 2, "reason": "budget",
                                      "bytes": 7, "count": 3}))[0] == "snapshot_skipped"
    assert reports.decode(json.dumps({"kind": "rejected", "iteration": 2, "slot": "a",
                                      "reason": "checksum"}))[0] == "snapshot_rejected"


@pytest.mark.parametrize("message", [
    "", "not json", "[]", "{}", '{"kind": "restored"}', "1e999" * 3, "[" * 100_000,
    json.dumps({"kind": "restored", "iteration": True, "source": "local", "bytes": 1,
                "seconds": 1}),
    json.dumps({"kind": "restored", "iteration": 1, "source": "disk", "bytes": 1, "seconds": 1}),
    json.dumps({"kind": "skipped", "iteration": 1, "reason": "whim", "bytes": 1, "count": 1}),
    json.dumps({"kind": "rejected", "iteration": 1, "slot": "d", "reason": "x"}),
    '{"kind": "restored", "iteration": 1, "source": "local", "bytes": 1, "seconds": NaN}',
])
def test_reports_decode_rejects_malformed_ones_without_raising(message):
    assert reports.decode(message) is None


# -- the area -----------------------------------------------------------------------------


def test_area_name_separates_users_jobs_and_run_dirs():
    names = {area_name(1000, "job", "/a"), area_name(1001, "job", "/a"),
             area_name(1000, "job2", "/a"), area_name(1000, "job", "/b")}
    assert len(names) == 4
    assert "/" not in area_name(1000, "../../etc", "/a")


def test_area_removes_a_stale_one_of_this_job_and_refuses_others(tmp_path):
    area = Area(tmp_path / "snap")
    area.make()
    assert stat.S_IMODE(os.stat(area.path).st_mode) == 0o700
    (area.path / "rank_0").mkdir(mode=0o700)
    again = Area(area.path)
    again.make()  # a stale one (SIGKILLed launcher): removed and made anew
    assert again.stale_removed and list(area.path.iterdir()) == []
    os.chmod(area.path, 0o755)
    with pytest.raises(AreaRefused, match="mode 755"):
        Area(area.path).make()
    os.chmod(area.path, 0o700)
    st = os.lstat(area.path)
    foreign = os.stat_result((st.st_mode, 0, 0, 1, os.geteuid() + 1, 0, 0, 0, 0, 0))
    with pytest.raises(AreaRefused, match="owned by uid"):
        check_leftover(area.path, foreign)
    link = tmp_path / "link"
    link.symlink_to(area.path)
    with pytest.raises(AreaRefused, match="not a directory"):
        Area(link).make()
    area.remove()
    assert not area.path.exists()


# -- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ("5", "5"), ("30s", "30s"), ("0.5s", "0.5s"), ("off", None), ("0", None), (None, None)])
def test_snapshot_every_option(value, expected):
    assert parse_ft_value("snapshot_every", value, "--ft-snapshot-every") == expected


@pytest.mark.parametrize("value", ["-1", "fast", "1.5", "s", "-2s"])
def test_snapshot_every_option_refuses(value):
    with pytest.raises(ConfigError, match="--ft-snapshot-every"):
        parse_ft_value("snapshot_every", value, "--ft-snapshot-every")


def test_snapshot_memory_and_replicas_options():
    assert parse_ft_value("snapshot_memory", "2GB", "m") == 2 * 2**30
    assert parse_ft_value("snapshot_memory", "auto", "m") is None
    with pytest.raises(ConfigError):
        parse_ft_value("snapshot_memory", "0", "m")
    assert parse_ft_value("snapshot_replicas", "1", "r") == 1
    with pytest.raises(ConfigError):
        parse_ft_value("snapshot_replicas", "-1", "r")


# -- the agent's side ---------------------------------------------------------------------


def test_frequency_in_steps_and_seconds():
    assert Frequency.parse("3") == Frequency(steps=3)
    assert Frequency.parse("2.5s") == Frequency(seconds=2.5)
    assert Frequency.parse("0") is None and Frequency.parse("x") is None
    steps = Frequency(steps=3)
    assert steps.due(1, 0.0, None) and not steps.due(2, 0.0, (1, 0.0)) and steps.due(3, 0, (1, 0))
    # on the grid of multiples: a rank that took 7 (6 came while it was busy) is due at 9
    # with the others, not 3 steps after its late one
    assert not steps.due(8, 0.0, (7, 0.0)) and steps.due(9, 0.0, (7, 0.0))
    secs = Frequency(seconds=2.0)  # the clock is injected: no sleeping
    assert not secs.due(9, 101.9, (1, 100.5)) and secs.due(2, 102.0, (1, 100.5))
    # two ranks whose last snapshots came at different times within one period are due at
    # the same multiple of the wall clock
    assert [secs.due(5, t, (1, 100.1)) for t in (101.99, 102.01)] == [False, True]
    assert [secs.due(5, t, (2, 101.7)) for t in (101.99, 102.01)] == [False, True]


def test_settings_from_env():
    env = {"FT_SNAPSHOT_DIR": "/x", "FT_SNAPSHOT_EVERY": "2", "FT_SNAPSHOT_MEMORY": "100",
           "FT_SNAPSHOT_ITERATION": "none"}
    s = settings_from_env(env)
    assert s is not None and s.memory == 100 and s.iteration is None
    assert settings_from_env({**env, "FT_SNAPSHOT_ITERATION": "7"}).iteration == 7
    assert settings_from_env({"FT_SNAPSHOT_EVERY": "2"}) is None


def test_client_without_launcher_is_a_no_op_with_one_warning(monkeypatch):
    monkeypatch.delenv("FT_ENDPOINT", raising=False)
    client = RankMonitorClient()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert client.snapshot({"w": torch.zeros(2)}, 1) is None
        assert client.restore() is None
        assert client.snapshot({"w": torch.zeros(2)}, 2) is None
    assert len(caught) == 1 and "FT_ENDPOINT" in str(caught[0].message)


def agent(directory: Path, every: str = "1", memory: int | None = None,
          iteration: int | None = None) -> tuple[SnapshotAgent, list[dict]]:
    sent: list[dict] = []
    env = {"FT_SNAPSHOT_DIR": str(directory), "FT_SNAPSHOT_EVERY": every,
           "FT_SNAPSHOT_MEMORY": str(memory or 0),
           "FT_SNAPSHOT_ITERATION": "none" if iteration is None else str(iteration)}
    settings = settings_from_env(env)
    assert settings is not None
    return SnapshotAgent(settings, lambda what, msg: sent.append(json.loads(msg))), sent


def test_agent_honours_frequency_and_reports_budget_skips(tmp_path):
    a, sent = agent(tmp_path / "r0", every="3", memory=10_000)  # 2 slots of 40 B + header
    first = a.snapshot({"w": torch.zeros(10)}, 1)
    assert first.reason == "claim"  # the slot's memory, claimed in the background
    a.store.wait()
    assert a.snapshot({"w": torch.zeros(10)}, 3).started  # the first of the cycle: due
    assert a.snapshot({"w": torch.zeros(10)}, 4) is None  # not due
    a.store.wait()
    status = a.snapshot({"w": torch.zeros(1000)}, 6)  # 4000 bytes: over the budget
    assert not status.started and status.reason == "budget"
    assert [m for m in sent if m["kind"] == "skipped"] == [
        {"kind": "skipped", "iteration": 1, "reason": "claim", "bytes": 40, "count": 1},
        {"kind": "skipped", "iteration": 6, "reason": "budget", "bytes": 4000, "count": 1}]
    a.close()


def test_agent_restores_the_chosen_iteration_and_refuses_a_corrupt_one(tmp_path):
    a, _ = agent(tmp_path / "r0")
    for it in (1, 2):  # at once: written before it returns, its slot claimed first
        assert a.snapshot({"w": torch.full((4,), float(it))}, it, at_once=True).started
    a.close()
    b, sent = agent(tmp_path / "r0", iteration=1)
    state, it = b.restore()
    assert it == 1 and torch.equal(state["w"], torch.ones(4))
    assert sent[0]["kind"] == "restored" and sent[0]["source"] == "local"
    assert b.restore() is None  # once per cycle
    flip_last_byte(tmp_path / "r0" / "slot_b.bin")
    c, sent = agent(tmp_path / "r0", iteration=2)
    with pytest.raises(store.SnapshotError):
        c.restore()
    assert sent[0]["kind"] == "rejected" and sent[0]["slot"] == "b"
    assert store.available_iterations(tmp_path / "r0") == [1]  # uncommitted: never again


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- the launcher's choice at a cycle start, on real files --------------------------------


def service(tmp_path: Path) -> tuple[JobSnapshots, list[tuple[str, dict]]]:
    evs: list[tuple[str, dict]] = []
    (tmp_path / "shm").mkdir(exist_ok=True)
    job = JobSnapshots(SnapshotOptions("1", 2**20), "run", tmp_path / "run", tmp_path / "ipc",
                       lambda name, **f: evs.append((name, f)), 2, shm=tmp_path / "shm")
    return job, evs


def write(job: JobSnapshots, rank: int, iterations: list[int]) -> None:
    with store.SnapshotStore(job.area.rank_dir(rank)) as s:
        for it in iterations:
            s.snapshot({"w": torch.full((8,), float(it)), "it": it}, it, wait=True)


def test_service_picks_verifies_and_discards(tmp_path):
    job, evs = service(tmp_path)
    env = job.begin_cycle([0, 1], 1)
    assert env[0]["FT_SNAPSHOT_ITERATION"] == "none" and env[1]["FT_SNAPSHOT_MEMORY"] == str(2**19)
    assert evs[0][0] == "snapshots_ready"
    assert not job.area.path.exists()  # made by the first rank to snapshot: none yet
    write(job, 0, [3, 4, 5])
    assert stat.S_IMODE(os.stat(job.area.path).st_mode) == 0o700
    write(job, 1, [3, 4])
    evs.clear()
    env = job.begin_cycle([0, 1], 1)
    assert env[0]["FT_SNAPSHOT_ITERATION"] == env[1]["FT_SNAPSHOT_ITERATION"] == "4"
    picked = dict(evs)["snapshot_picked"]
    assert picked["ranks"] == {"0": [4, 5], "1": [3, 4]} and picked["discarded"] == [[0, "a", 5]]
    assert store.available_iterations(job.area.rank_dir(0)) == [4]  # the future is gone
    # A copy corrupted between cycles is rejected by the launcher before any rank loads it.
    commit = store.committed_slots(job.area.rank_dir(1))[0]
    slot = next(s.slot for s in commit if s.iteration == 4)
    flip_last_byte(job.area.rank_dir(1) / store.slot_file(slot))
    evs.clear()
    env = job.begin_cycle([0, 1], 1)
    assert env[0]["FT_SNAPSHOT_ITERATION"] == "none"
    names = [n for n, _ in evs]
    assert names == ["snapshot_rejected", "snapshot_picked"]
    assert "checksum" in evs[0][1]["reason"] and evs[0][1]["by"] == "launcher"
    assert evs[1][1]["reason"] == "no iteration is held by every rank"  # 4 on 0, 3 on 1
    path = job.area.path
    job.close()
    assert not path.exists()


def test_service_several_nodes_restore_nothing_yet(tmp_path):
    job, evs = service(tmp_path)
    job.begin_cycle([2, 3], 1)
    write(job, 2, [1])
    write(job, 3, [1])
    env = job.begin_cycle([2, 3], 2)
    assert env[2]["FT_SNAPSHOT_ITERATION"] == "none"
    assert "several nodes" in dict(evs)["snapshot_picked"]["reason"]
    job.close()


def test_service_refused_area_turns_snapshots_off(tmp_path):
    job, evs = service(tmp_path)
    job.area.path.mkdir(mode=0o755)
    os.chmod(job.area.path, 0o755)
    assert job.begin_cycle([0, 1], 1) == {}
    assert evs[0][0] == "snapshots_off" and "mode 755" in evs[0][1]["reason"]
    job.close()
    assert job.area.path.exists()  # not ours to remove


def test_a_launcher_that_never_made_its_area_removes_its_predecessors_at_close(tmp_path):
    """A spare never admitted makes no area; the one a SIGKILLed launcher of the same run
    directory left must still go when it exits (the two-node soak found it in /dev/shm)."""
    killed, _ = service(tmp_path)
    killed.begin_cycle([0], 1)
    write(killed, 0, [1])  # SIGKILLed now: no close()
    spare, evs = service(tmp_path)
    spare.close()
    assert not spare.area.path.exists() and evs == []
    again, _ = service(tmp_path)
    again.area.path.mkdir(mode=0o755)
    os.chmod(again.area.path, 0o755)
    again.close()
    assert again.area.path.exists()  # not a private directory: not ours to remove
    off = JobSnapshots(SnapshotOptions(None, None), "run", tmp_path / "run", tmp_path / "ipc",
                       lambda name, **f: None, 1, shm=tmp_path / "shm")
    off.close()
    assert again.area.path.exists()  # snapshots off: it touches nothing

def test_service_rank_reports_become_events(tmp_path):
    job, evs = service(tmp_path)
    job.on_report(1, json.dumps({"kind": "restored", "iteration": 4, "source": "local",
                                 "bytes": 8, "seconds": 0.01}))
    job.on_report(1, "garbage")
    assert evs[0] == ("snapshot_restored", {"rank": 1, "iteration": 4, "source": "local",
                                            "bytes": 8, "seconds": 0.01})
    assert evs[1][0] == "rank_report"


# -- Lightning: the callback's snapshot and restore, on a real Trainer --------------------


def test_lightning_state_round_trips_through_a_snapshot(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from ft_agent.lightning import restore_fit_state, snapshot_fit_state

    class Module(pl.LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Hook(pl.Callback):
        def __init__(self, client) -> None:
            self.client, self.restored, self.at_start = client, None, None

        def on_train_start(self, trainer, module):
            self.restored = restore_fit_state(self.client, trainer, module)
            self.at_start = module.layer.weight.detach().clone()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            snapshot_fit_state(self.client, trainer, module, 2)
            if self.client.store is not None:
                self.client.store.wait()

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)),
                                       batch_size=2)
    kw = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
          "enable_progress_bar": False, "enable_model_summary": False,
          "default_root_dir": str(tmp_path)}
    first, _ = agent(tmp_path / "r0", every="1")
    module = Module(0)
    pl.Trainer(max_steps=4, callbacks=[Hook(first)], **kw).fit(module, data)
    first.close()
    # step 2's snapshot claimed the slot's memory (the step never waits for it): 4 is taken
    assert store.available_iterations(tmp_path / "r0") == [4]
    second, sent = agent(tmp_path / "r0", iteration=4)
    hook = Hook(second)
    trainer = pl.Trainer(max_steps=6, callbacks=[hook], **kw)
    trainer.fit(Module(1), data)
    second.close()
    assert hook.restored == 4 and torch.equal(hook.at_start, module.layer.weight.detach())
    assert trainer.global_step == 6  # two more steps: the counter resumed at 4
    assert sent[0]["kind"] == "restored"


# -- the goodput ledger: a restored snapshot is where the lost work starts ----------------

T0 = 1_800_000_000.0


def rec(t: float, event: str, cycle: int, **fields) -> dict:
    """An events.jsonl record ``t`` seconds after T0."""
    return {"ts": T0 + t, "event": event, "cycle": cycle, **fields}



def test_ledger_counts_work_lost_from_the_restored_snapshot():
    from ft_launcher.observe.ledger import ledger_of
    from ft_launcher.observe.report import resume_lines

    def run(restored: int | None) -> dict:
        records = [
            rec(0, "launcher_started", 0), rec(0.5, "rendezvous_done", 0),
            rec(1, "workers_started", 0, ranks=[0, 1]),
            rec(3, "first_step", 0, rank=0, iteration=1),
            rec(3, "first_step", 0, rank=1, iteration=1),
            rec(8, "checkpoint_saved", 0, rank=0, iteration=50),
            rec(12.5, "fault_injected", 0, rank=1, fault_type="rank_killed", at=T0 + 12.5),
            rec(12.6, "worker_exited", 0, rank=1, exit_code=None, signal="SIGKILL",
                stopped_by_launcher=False),
            rec(13, "last_progress", 0, rank=0, iteration=120, at=T0 + 12.45),
            rec(13, "last_progress", 0, rank=1, iteration=119, at=T0 + 12.4),
            rec(13.1, "decision", 0, outcome="failed", restart=True, reason="rank 1 failed"),
            rec(13.2, "restart", 1, restarts=1, reason="rank 1 failed"),
            rec(13.7, "rendezvous_done", 1),
            rec(13.8, "snapshot_picked", 1, iteration=restored, reason="r"),
            rec(14, "workers_started", 1, ranks=[0, 1]),
            rec(16, "first_step", 1, rank=0, iteration=(restored or 50) + 1),
            rec(24, "last_progress", 1, rank=0, iteration=200, at=T0 + 23.5),
            rec(24.5, "decision", 1, outcome="succeeded", restart=False, reason="done"),
            rec(25, "launcher_exited", 1, exit_code=0, reason="done"),
        ]
        return ledger_of(records).summary()

    with_snapshot, without = run(119), run(None)
    c0 = with_snapshot["attempts"][0]["cycles"][0]
    assert (c0["checkpoint_step"], c0["checkpoint_source"]) == (119, "snapshot")
    assert c0["work_lost_steps"] == 1 and c0["work_lost_s"] == pytest.approx(0.1)
    assert "from its snapshot of step 119" in resume_lines(with_snapshot)[0]
    d0 = without["attempts"][0]["cycles"][0]
    assert (d0["checkpoint_step"], d0["checkpoint_source"]) == (50, "checkpoint")
    assert d0["work_lost_steps"] == 70 and d0["work_lost_s"] == pytest.approx(4.5)


def test_ledger_counts_a_hangs_restored_snapshot_reported_after_the_last_heartbeat():
    """A hung rank's fault is placed at its last heartbeat, which a step sends just before
    it reports its progress: the restored step's time then trails the fault by a hair, and
    the snapshot must still count (it did not: the whole cycle was charged as lost)."""
    from ft_launcher.observe.ledger import ledger_of

    records = [
        rec(0, "launcher_started", 0), rec(0.5, "rendezvous_done", 0),
        rec(1, "workers_started", 0, ranks=[0, 1]),
        rec(3, "first_step", 0, rank=0, iteration=1),
        rec(3, "first_step", 0, rank=1, iteration=1),
        # rank 0's heartbeat of step 428 at 30.0, its progress report 1 ms later; frozen
        rec(35, "hang_detected", 0, rank=0, timeout_kind="heartbeat", silence_s=5.0,
            detected_at=T0 + 35.0),
        rec(35.05, "worker_exited", 0, rank=0, exit_code=None, signal="SIGKILL",
            stopped_by_launcher=True),
        rec(35.05, "last_progress", 0, rank=0, iteration=428, at=T0 + 30.001),
        rec(35.05, "last_progress", 0, rank=1, iteration=429, at=T0 + 30.05),
        rec(35.1, "decision", 0, outcome="hung", restart=True, reason="rank 0 hung"),
        rec(35.1, "restart", 1, restarts=1, reason="rank 0 hung"),
        rec(35.1, "rendezvous_done", 1),
        rec(35.1, "snapshot_picked", 1, iteration=428, reason="r"),
        rec(35.1, "workers_started", 1, ranks=[0, 1]),
        rec(35.3, "first_step", 1, rank=0, iteration=429),
        rec(35.3, "first_step", 1, rank=1, iteration=429),
        rec(60, "last_progress", 1, rank=0, iteration=800, at=T0 + 59.9),
        rec(60, "decision", 1, outcome="succeeded", restart=False, reason="done"),
        rec(60.1, "launcher_exited", 1, exit_code=0, reason="done"),
    ]
    c0 = ledger_of(records).summary()["attempts"][0]["cycles"][0]
    assert (c0["checkpoint_step"], c0["checkpoint_source"]) == (428, "snapshot")
    assert c0["work_lost_s"] == 0.0 and c0["work_lost_steps"] == 1
    assert c0["productive_s"] == pytest.approx(27.0)
    assert not c0["no_progress"]


def test_the_launcher_and_import_ft_agent_stay_without_torch():
    code = ("import sys, ft_agent, ft_agent.client, ft_agent.snapshot, ft_launcher.cli, "
            "ft_launcher.cycle, ft_launcher.snapshots.service; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parent.parent)


def test_a_write_in_flight_at_exit_is_finished_within_a_bound(tmp_path):
    # 80 MB: the background write is still running when the script's last line returns.
    code = ("import torch, time; from ft_agent.client import RankMonitorClient\n"
            "c = RankMonitorClient()\n"
            "s = c.snapshot({'w': torch.ones(20_000_000)}, 1)\n"
            "assert s.reason == 'claim', s\n"
            "c._snapshots.store.wait()\n"
            "s = c.snapshot({'w': torch.ones(20_000_000)}, 2)\n"
            "assert s.started, s\n"
            "print('busy' if c._snapshots.store._busy() else 'done', flush=True)\n")
    env = {**os.environ, "FT_ENDPOINT": "ipc:///nonexistent", "FT_SNAPSHOT_EVERY": "1",
           "FT_SNAPSHOT_DIR": str(tmp_path / "r0"), "FT_SNAPSHOT_ITERATION": "none"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("busy", "done")
    # ... and is finished at exit: its snapshot is there, whole and checked
    assert store.available_iterations(tmp_path / "r0") == [2]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4), max_leaves=20)


@given(kind=st.sampled_from(["skipped", "restored", "rejected", "other"]),
       fields=st.dictionaries(st.sampled_from(["iteration", "reason", "bytes", "count",
                                               "source", "seconds", "slot", "event"]),
                              JSON_VALUES, max_size=8))
@settings(max_examples=300, deadline=None)
def test_reports_decode_never_raises_and_keeps_only_checked_fields(kind, fields):
    decoded = reports.decode(json.dumps({"kind": kind, **fields}))
    if decoded is not None:
        name, out = decoded
        assert name.startswith("snapshot_") and "event" not in out
        assert all(v is not None for v in out.values())


def test_area_falls_back_to_the_run_directory_without_shared_memory(tmp_path):
    assert default_root(tmp_path / "ipc", shm=tmp_path / "no-shm") == tmp_path / "ipc"
    (tmp_path / "shm").mkdir()
    assert default_root(tmp_path / "ipc", shm=tmp_path / "shm") == tmp_path / "shm"


def test_agent_goes_on_without_snapshots_when_its_directory_is_refused(tmp_path):
    bad = tmp_path / "r0"
    bad.mkdir(mode=0o755)
    os.chmod(bad, 0o755)
    a, sent = agent(bad)
    assert a.snapshot({"w": torch.zeros(2)}, 1) is None
    assert a.snapshot({"w": torch.zeros(2)}, 2) is None
    assert sent == [{"kind": "skipped", "iteration": 1, "reason": "io", "bytes": 0, "count": 1}]
