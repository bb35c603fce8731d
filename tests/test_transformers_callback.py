"""ft_agent.transformers and ft_agent.stateful, in one process, on a real HF Trainer.

The Trainer is examples/hf_trainer.py's (a tiny GPT-2, random tokens, CPU) and the
snapshots go to a real store in a temporary directory (ft_agent's SnapshotAgent, as a rank
under the launcher has it). What stands in for the launcher is the callback's connection to
the monitor (``Monitorless``: it records what the callback reports); the launcher's own
choice of the iteration to restore is given as it would be in the environment. The same
callback under a real launcher, killed and restarted, is in tests/stacks/.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from launch_helpers import EXAMPLES, ROOT
from torch_support import skip_below_torch_2_6

from ft_agent.client import RankMonitorClient
from ft_agent.snapshot_client import SnapshotAgent, settings_from_env
from ft_agent.stateful import RNGState, StatefulList, restore_stateful, snapshot_stateful

skip_below_torch_2_6("transformers")
from transformers import TrainerCallback  # noqa: E402

from ft_agent.transformers import FaultToleranceCallback  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_trainer_example",
                                                  EXAMPLES / "hf_trainer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def agent(directory: Path, iteration: int | None = None,
          sent: list[str] | None = None) -> SnapshotAgent:
    """A rank's snapshot side as the launcher sets it up: a snapshot offered at every
    step, and ``iteration`` the one to restore in this cycle (the launcher's choice);
    the kinds of its reports to the launcher go to ``sent``."""
    settings = settings_from_env({"FT_SNAPSHOT_DIR": str(directory), "FT_SNAPSHOT_EVERY": "1",
                                  "FT_SNAPSHOT_MEMORY": "0",
                                  "FT_SNAPSHOT_ITERATION": "none" if iteration is None
                                  else str(iteration)})
    assert settings is not None
    return SnapshotAgent(settings, lambda what, message: sent is not None
                         and sent.append(json.loads(message)["kind"]))


class Monitorless:
    """The callback's client without a monitor: reports are recorded; snapshot() and
    restore() are the real store's (each snapshot written before the next step, so the
    test knows which steps it holds)."""

    is_initialized = True
    cycle = 0

    def __init__(self, snapshots: SnapshotAgent | None = None) -> None:
        self.snapshots = snapshots
        self.sent: list[tuple[str, int | None]] = []

    def init_workload_monitoring(self) -> None:
        self.sent.append(("hello", None))

    def send_heartbeat(self) -> None:
        self.sent.append(("heartbeat", None))

    def report_progress(self, iteration: int) -> None:
        self.sent.append(("progress", iteration))

    def report_checkpoint(self, iteration: int) -> None:
        self.sent.append(("checkpoint", iteration))

    def shutdown_workload_monitoring(self) -> None:
        self.sent.append(("goodbye", None))

    def snapshot(self, state: Any, iteration: int) -> Any:
        assert self.snapshots is not None
        status = self.snapshots.snapshot(state, iteration)
        if status is not None and status.reason == "claim":
            # A fresh slot's memory is claimed in the background and that step skipped;
            # here the step is taken once the slot is ready, so the test knows every step
            # a snapshot holds.
            self.snapshots.store.wait()
            status = self.snapshots.snapshot(state, iteration, at_once=True)
        if status is not None and status.started:
            self.snapshots.store.wait()
        return status

    def restore(self, newer_than: int | None = None) -> Any:
        return self.snapshots.restore(newer_than) if self.snapshots is not None else None

    def kinds(self, kind: str) -> list[int | None]:
        return [it for k, it in self.sent if k == kind]


class StopAt(TrainerCallback):
    """Ends train() after step ``step``, as a fault would (its checkpoint, if due, is
    written first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class Probe(TrainerCallback):
    """What the Trainer holds when training begins (after every other callback's
    on_train_begin) and the steps it then trains."""

    def __init__(self) -> None:
        self.at_start: dict[str, Any] = {}
        self.steps: list[int] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        self.at_start = {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "lr_scheduler": copy.deepcopy(lr_scheduler.state_dict()),
            "global_step": state.global_step, "epoch": state.epoch,
            "log_history": copy.deepcopy(state.log_history),
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
        }

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


class Fetches(torch.utils.data.Dataset):
    """The Trainer's dataset, recording the index of every sample it hands out."""

    def __init__(self, data: torch.utils.data.Dataset) -> None:
        self.data, self.seen = data, []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        self.seen.append(int(i))
        return self.data[i]


BATCH = 4


def train(out: Path, callbacks: list[TrainerCallback], resume: str | None = None,
          max_steps: int = 12) -> tuple[Any, Fetches]:
    args = EXAMPLE.parse_args(["--output-dir", str(out), "--max-steps", str(max_steps),
                               "--save-steps", "3", "--logging-steps", "2", "--samples", "256",
                               "--batch-size", str(BATCH), "--seq-len", "8"])
    trainer = EXAMPLE.build_trainer(args, callbacks)
    trainer.train_dataset = fetches = Fetches(trainer.train_dataset)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, fetches


def batches(fetches: Fetches) -> list[list[int]]:
    return [fetches.seen[i:i + BATCH] for i in range(0, len(fetches.seen), BATCH)]


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Nested states equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


# -- the callback on a real Trainer ---------------------------------------------------------


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A training stopped after step 9 of 12, as a fault would stop it: disk checkpoints at
    steps 6 and 9, snapshots of steps 8 and 9 (a rank's store keeps the newest two)."""
    root = tmp_path_factory.mktemp("hf")
    client = Monitorless(agent(root / "snap"))
    trainer, fetches = train(root / "out", [FaultToleranceCallback(client=client), StopAt(9)])
    client.snapshots.close()
    return {"root": root, "client": client, "fetches": fetches,
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def test_reports_progress_and_checkpoints_and_snapshots_every_step(interrupted):
    client = interrupted["client"]
    assert client.kinds("progress") == list(range(1, 10))
    assert client.kinds("checkpoint") == [3, 6, 9]
    assert client.kinds("hello") and client.kinds("heartbeat")
    assert client.kinds("goodbye") == [None]  # at the end of train(): after it, not judged
    from ft_agent import snapshot as store

    assert store.available_iterations(interrupted["root"] / "snap") == [8, 9]


def restarted(interrupted: dict[str, Any], tmp_path: Path, iteration: int) -> Monitorless:
    """The interrupted rank's snapshots as a restarted rank finds them (a copy: it goes on
    taking snapshots there), with ``iteration`` to restore."""
    snaps = tmp_path / "snap"
    shutil.copytree(interrupted["root"] / "snap", snaps)
    return Monitorless(agent(snaps, iteration))


def test_resumes_from_a_newer_snapshot_as_from_a_checkpoint_of_its_step(interrupted, tmp_path):
    """train() from checkpoint-6 with the snapshot of step 9: at the start of training the
    Trainer holds what train() from checkpoint-9 (HF's own resume) holds; the data loader
    goes on from checkpoint-6's position."""
    root, out = tmp_path, interrupted["root"] / "out"
    ours, probe = restarted(interrupted, tmp_path, 9), Probe()
    callback = FaultToleranceCallback(client=ours)
    _, fetched = train(root / "from_snapshot", [callback, probe],
                       resume=str(out / "checkpoint-6"))
    hf_probe = Probe()
    _, hf_fetched = train(root / "from_checkpoint", [hf_probe],
                          resume=str(out / "checkpoint-9"))

    assert callback.restored_step == 9
    got, want = probe.at_start, hf_probe.at_start
    assert_same(got["model"], interrupted["weights"])
    for key in ("model", "optimizer", "lr_scheduler", "global_step", "epoch", "log_history"):
        assert_same(got[key], want[key], key)
    assert got["log_history"] and got["log_history"][-1]["step"] == 8
    # HF restores the generators from checkpoint-9's rng_state.pth as the epoch starts
    # (after this event); ours are those of the same moment of the first run.
    saved = torch.load(out / "checkpoint-9" / "rng_state.pth", weights_only=False)
    assert torch.equal(got["torch_rng"], saved["cpu"])
    assert got["python_rng"] == saved["python"]
    assert_same([torch.as_tensor(x) if isinstance(x, np.ndarray) else x
                 for x in got["numpy_rng"]],
                [torch.as_tensor(x) if isinstance(x, np.ndarray) else x
                 for x in saved["numpy"]], "numpy")
    # Both train steps 10 to 12. The snapshot's run takes the batches that train() from
    # checkpoint-6 skips to (those of the first run's steps 7 to 9), HF's the next ones
    # (the loader fetches a batch ahead: the first run fetched step 10's too).
    assert probe.steps == hf_probe.steps == [10, 11, 12]
    first = batches(interrupted["fetches"])
    assert batches(fetched)[:3] == first[6:9]
    assert batches(hf_fetched)[0] == first[9]
    assert ours.kinds("progress") == [10, 11, 12]


def test_a_disk_checkpoint_newer_than_the_snapshot_wins(interrupted, tmp_path):
    probe = Probe()
    callback = FaultToleranceCallback(client=restarted(interrupted, tmp_path, 8))
    train(tmp_path / "out", [callback, probe],
          resume=str(interrupted["root"] / "out" / "checkpoint-9"))
    assert callback.restored_step is None
    assert probe.at_start["global_step"] == 9
    assert_same(probe.at_start["model"], interrupted["weights"])


def test_without_the_launcher_one_warning_and_the_training_runs(tmp_path):
    client = RankMonitorClient()  # FT_ENDPOINT unset (conftest): not under the launcher
    with pytest.warns(RuntimeWarning, match="FT_ENDPOINT is not set") as warned:
        trainer, _ = train(tmp_path / "out", [FaultToleranceCallback(client=client)],
                           max_steps=4)
    assert len([w for w in warned if "FT_ENDPOINT" in str(w.message)]) == 1
    assert trainer.state.global_step == 4 and not client.is_initialized


def test_snapshots_off_keeps_the_reports(tmp_path):
    client = Monitorless(agent(tmp_path / "snap"))
    train(tmp_path / "out", [FaultToleranceCallback(snapshots=False, client=client)],
          max_steps=3)
    from ft_agent import snapshot as store

    assert client.kinds("progress") == [1, 2, 3]
    assert store.available_iterations(tmp_path / "snap") == []


def test_imports_stay_light_and_the_extra_is_named():
    code = ("import sys, ft_agent\n"
            "heavy = [m for m in ('torch', 'transformers', 'zmq') if m in sys.modules]\n"
            "assert not heavy, f'import ft_agent imported {heavy}'\n"
            "assert callable(ft_agent.snapshot_stateful) and callable(ft_agent.restore_stateful)\n"
            "sys.modules['transformers'] = None\n"
            "try:\n"
            "    import ft_agent.transformers\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'ft-launcher[transformers]'" in proc.stdout


# -- the Stateful helpers ---------------------------------------------------------------------


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def app_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    return {"model": model, "optimizers": StatefulList([opt]), "lr_scheduler": sched,
            "rng": RNGState(), "train_state": Counter(seed)}


def test_stateful_round_trip_restores_every_object_and_the_generators(tmp_path):
    saved = app_state(1)
    writer = Monitorless(agent(tmp_path / "r0"))
    assert snapshot_stateful(saved, 7, client=writer).started
    draws = (random.random(), np.random.rand(), torch.rand(2))  # after the snapshot
    writer.snapshots.close()

    target = app_state(2)
    reader = agent(tmp_path / "r0", iteration=7)
    assert restore_stateful(target, client=reader) == 7
    assert_same(target["model"].state_dict(), saved["model"].state_dict())
    assert_same(target["optimizers"].items[0].state_dict(), saved["optimizers"].items[0]
                .state_dict())
    assert target["lr_scheduler"].state_dict() == saved["lr_scheduler"].state_dict()
    assert target["train_state"].n == 1
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert again[:2] == draws[:2] and torch.equal(again[2], draws[2])
    assert restore_stateful(target, client=reader) is None  # once per cycle
    reader.close()


def test_stateful_restore_rules(tmp_path):
    writer = Monitorless(agent(tmp_path / "r0"))
    assert snapshot_stateful({"a": Counter(5)}, 4, client=writer).started
    writer.snapshots.close()

    older, sent = {"a": Counter()}, []
    assert restore_stateful(older, newer_than=4, client=agent(tmp_path / "r0", 4, sent)) is None
    # A checkpoint of step 4 is loaded already: nothing changes, nothing is reported
    # restored (the launcher's record would otherwise name a step the training did not take).
    assert older["a"].n == 0 and sent == []
    sent = []
    assert restore_stateful(older, newer_than=3, client=agent(tmp_path / "r0", 4, sent)) == 4
    assert older["a"].n == 5 and sent == ["restored"]
    with pytest.raises(ValueError, match="holds no state for 'b'"):
        restore_stateful({"a": Counter(), "b": Counter()}, client=agent(tmp_path / "r0", 4))
    with pytest.raises(TypeError, match=r"app_state\['w'\]: Tensor has no state_dict"):
        snapshot_stateful({"w": torch.zeros(1)}, 1, client=writer)
    with pytest.raises(ValueError, match="a snapshot of 1 objects cannot be loaded into 2"):
        StatefulList([Counter(), Counter()]).load_state_dict({"items": [{"n": 1}]})
    first = agent(tmp_path / "none")
    assert restore_stateful({"a": Counter()}, client=first) is None  # first cycle


def test_stateful_outside_the_launcher_does_nothing(tmp_path):
    client = RankMonitorClient()
    with pytest.warns(RuntimeWarning, match="FT_ENDPOINT is not set"):
        assert snapshot_stateful({"a": Counter(1)}, 1, client=client) is None
    assert restore_stateful({"a": Counter(1)}, client=client) is None
