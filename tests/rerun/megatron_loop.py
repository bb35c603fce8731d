"""Megatron-LM's ``train()`` loop around the rerun state machine, emulated (test helper).

One process per rank runs several jobs in a row, like a requeued Slurm job: each job gets a
simulated host and device, reads the tracker file while parsing its arguments, starts a
fresh gloo process group, loads the latest checkpoint, resumes its data loader at the
checkpoint's consumed samples, trains, saves a checkpoint when the machine asks and ends
with the machine's exit code. What Megatron-LM does and where (megatron/training/):

* arguments.py: ``args.iterations_to_skip.extend(get_skipped_iterations_from_tracker_file())``
  on every rank, before torch.distributed exists;
* initialize.py: ``initialize_rerun_state_machine(state_save_func, state_restore_func, mode,
  error_injector, result_rejected_tracker_filename)``;
* checkpointing.py: the checkpoint holds ``iteration`` (completed steps), the consumed
  samples, the RNG state (per rank) and ``state_dict(train_data_iterator, "torch_dist")``;
  torch_dist stores ``ShardedObject`` parts per rank and everything else once, from rank 0.
  Loading: ``if validate_state_dict(common): template = state_dict(None, fmt, force=True)``,
  shards filled from the files, then ``load_state_dict`` inside ``try`` ("Unable to restore
  RerunMachine from checkpoint ... Skipping");
* training.py: ``current_iteration`` overwritten with ``args.iteration``; ``if iteration + 1
  in args.iterations_to_skip: dummy_train_step(...)``, counters advance; else ``train_step``
  (``while should_run_forward_backward(data_iterator)`` over ``num_microbatches``
  microbatches, ``should_checkpoint_and_exit()``, optimizer step); ``if should_checkpoint:
  save_checkpoint(iteration, ...)``; ``if should_exit: break``; ``sys.exit(exit_code)``;
* pretrain_gpt.py loss_func: ``validate_result(loss, torch.isnan, "found NaN in local
  forward loss calculation", fatal=True)`` per microbatch, and a non-fatal "Spiky loss" check
  with ``is_unexpectedly_large``.

The only changes to that loop: ``import rerun.rerun_state_machine as rerun_state_machine``
and, when the job asks for it, ``share_iterations_to_skip`` (one line). Sample ids follow
Megatron's pretraining sampler: step ``k`` (1-based), microbatch ``m``, data-parallel rank
``r`` reads global samples ``(k-1)*GB + m*MBS*DP + r*MBS ...`` (GB = MBS*DP*microbatches).

Usage: ``python megatron_loop.py SPEC.json OUT_DIR`` with RANK and WORLD_SIZE set; runs
each scenario in ``OUT_DIR/<name>`` (its checkpoints and tracker file) and writes
``OUT_DIR/rank<r>.json``: per scenario, per job, what each step read. SPEC: {"scenarios":
{name: {"train_iters": n, "jobs": [job, ...]}}}; a job: ``{"host", "devices": [per rank],
"mode", "faults": [...], "iterations_to_skip": [...], "iterations_to_skip_by_rank": [...],
"share_skip": bool, "rerun_ckpt_override": "none"|"empty"|"not_running"|"megatron",
"no_megatron": bool, "report_every": n, "job_id": str}``. Faults:
``{"kind": "data", "sample": id}`` (NaN whenever that sample is read: the input is bad),
``{"kind": "device", "rank", "device", "step"}`` (NaN on that device at that step),
``{"kind": "transient", "rank", "step"}`` (NaN on the first pass, in this job only),
``{"kind": "vanishing", "rank", "step"}`` (a rejecting check only the first pass makes).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import rerun.identity  # noqa: E402  (the simulated host of each job)
import rerun.rerun_state_machine as rerun_state_machine  # noqa: E402  (the changed import)
from rerun.rerun_state_machine import (  # noqa: E402
    RerunDataIterator,
    RerunMode,
    RerunStateMachine,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)

_SHARDED_OBJECT_CLASS = rerun_state_machine._sharded_object_class
MBS = 2  # micro batch size
MICROBATCHES = 2
NAN_MESSAGE = "found NaN in local forward loss calculation"


class Sampler:
    """Megatron's MegatronPretrainingSampler: resumes at ``consumed`` samples; each step's
    global batch is split into microbatches, each into one slice per data-parallel rank."""

    def __init__(self, consumed: int, rank: int, world: int) -> None:
        self.next_sample, self.rank, self.world = consumed, rank, world

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        first = self.next_sample + self.rank * MBS
        self.next_sample += MBS * self.world
        ids = torch.arange(first, first + MBS)
        g = torch.Generator().manual_seed(int(first))
        x, y = torch.randn(MBS, 4, generator=g), torch.randn(MBS, 1, generator=g)
        return {"ids": ids, "x": x, "y": y}


class Job:
    """One job of the requeued Slurm job, on one rank."""

    def __init__(self, spec: dict, job: dict, index: int, rank: int, world: int, out: Path):
        self.spec, self.job, self.index, self.rank, self.world = spec, job, index, rank, world
        self.dir = out
        self.ckpt_dir = out / "ckpt"
        self.tracker = str(out / "tracker.txt")
        self.trace: dict[str, Any] = {"steps": [], "events": [], "log": []}
        self.pass_no = 0
        self.step = 0

    # ------------------------------------------------------------------ set-up (per job)
    def parse_args(self) -> None:
        """arguments.py: the skip list from the tracker file, on every rank, before
        torch.distributed is initialised."""
        self.iterations_to_skip = list(self.job.get("iterations_to_skip", []))
        by_rank = self.job.get("iterations_to_skip_by_rank")
        if by_rank:  # e.g. ranks with different views of the tracker file
            self.iterations_to_skip.extend(by_rank[self.rank])
        self.iterations_to_skip.extend(
            RerunStateMachine.get_skipped_iterations_from_tracker_file(self.tracker)
        )

    def initialize(self) -> None:
        os.environ["FT_DEVICE_ID"] = str(self.job["devices"][self.rank])
        os.environ["SLURM_JOB_ID"] = str(self.job.get("job_id", "1000"))
        host = self.job.get("host", "node-a")
        rerun.identity.current_host = lambda: host  # the simulated host of this job
        # Megatron-Core not importable in this job (it is installed for the others).
        rerun_state_machine._sharded_object_class = (
            (lambda: None) if self.job.get("no_megatron") else _SHARDED_OBJECT_CLASS
        )
        destroy_rerun_state_machine()
        initialize_rerun_state_machine(
            state_save_func=lambda: {"rng_tracker_states": None},
            state_restore_func=lambda state: None,
            mode=RerunMode(self.job.get("mode", "validate_results")),
            result_rejected_tracker_filename=self.tracker,
        )
        store = self.dir / f"store.{self.index}"
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=self.rank, world_size=self.world
        )
        torch.manual_seed(1234)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.iteration = 0
        self.consumed_train_samples = 0
        self.load_checkpoint()
        if self.job.get("share_skip"):
            self.iterations_to_skip = rerun_state_machine.share_iterations_to_skip(
                self.iterations_to_skip
            )
        machine = get_rerun_state_machine()
        self.trace["after_load"] = {
            "state": machine.state.name,
            "first_iteration_complete": machine.first_iteration_complete,
            "flags": [machine.rerun_requested, machine.checkpoint_requested,
                      machine.restart_again_requested, machine.continue_requested],
        }
        self.trace["iterations_to_skip"] = sorted(self.iterations_to_skip)
        self.data_iterator = RerunDataIterator(Sampler(self.consumed_train_samples,
                                                       self.rank, self.world))

    # ------------------------------------------------------------------ checkpointing
    def save_checkpoint(self, iteration: int) -> None:
        """torch_dist: ShardedObjects one file per rank, the rest once from rank 0."""
        machine = get_rerun_state_machine()
        rerun_sd = machine.state_dict(self.data_iterator, "torch_dist")
        shards = {"rng_state": [torch.get_rng_state()]}
        if rerun_sd is not None and hasattr(rerun_sd.get("sharded"), "global_offset"):
            obj = rerun_sd["sharded"]
            shards[f"{obj.key}@{tuple(obj.global_offset)}"] = obj.data
            rerun_sd = {**rerun_sd, "sharded": None}
        path = self.ckpt_dir / f"iter_{iteration:07d}"
        path.mkdir(parents=True, exist_ok=True)
        torch.save(shards, path / f"shard.{self.rank}.pt")
        if self.rank == 0:
            torch.save({"iteration": iteration, "consumed_train_samples":
                        self.consumed_train_samples, "model": self.model.state_dict(),
                        "optimizer": self.optimizer.state_dict(),
                        "rerun_state_machine": rerun_sd}, path / "common.pt")
        dist.barrier()
        if self.rank == 0:
            (self.ckpt_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        dist.barrier()
        self.trace["log"].append(f"saved checkpoint at iteration {iteration}")

    def load_checkpoint(self) -> None:
        latest = self.ckpt_dir / "latest_checkpointed_iteration.txt"
        if not latest.exists():
            return
        path = self.ckpt_dir / f"iter_{int(latest.read_text()):07d}"
        common = torch.load(path / "common.pt", weights_only=False)
        shards = torch.load(path / f"shard.{self.rank}.pt", weights_only=False)
        self.iteration = common["iteration"]
        self.consumed_train_samples = common["consumed_train_samples"]
        self.model.load_state_dict(common["model"])
        self.optimizer.load_state_dict(common["optimizer"])
        torch.set_rng_state(shards["rng_state"][0])
        rerun_sd = self._override(common["rerun_state_machine"])
        machine = get_rerun_state_machine()
        if machine.validate_state_dict(rerun_sd):
            template = machine.state_dict(None, "torch_dist", force=True)
            obj = template["sharded"]
            if hasattr(obj, "global_offset"):
                rerun_sd = {**rerun_sd, "sharded": shards[f"{obj.key}@{tuple(obj.global_offset)}"]}
            try:
                machine.load_state_dict(rerun_sd)
            except Exception as exc:  # what checkpointing.py does
                self.trace["log"].append(f"Unable to restore RerunMachine from checkpoint: {exc}")

    def _override(self, rerun_sd: Any) -> Any:
        """An older checkpoint's rerun entry, as the job asks."""
        kind = self.job.get("rerun_ckpt_override")
        if kind is None:
            return rerun_sd
        if kind == "none":
            return None
        if kind == "empty":
            return {}
        if kind == "not_running":
            return {**rerun_sd, "state": "NOT_RUNNING_YET"}
        if kind == "megatron":  # the layout Megatron-Core 0.16 writes (enums, no format)
            return {"mode": RerunMode.VALIDATE_RESULTS,
                    "state": rerun_state_machine.RerunState.WILL_RERUN_FROM_CHECKPOINT,
                    "current_iteration": self.iteration,
                    "sharded": {"rerun_requested": True, "checkpoint_requested": True,
                                "restart_again_requested": False, "continue_requested": False,
                                "failed_validation_call": None, "initial_result": None,
                                "suspicious_node": "x", "suspicious_device": 0,
                                "data_iterator_checkpoints": None, "large_value_counts": {},
                                "max_values": {}, "error_injector_checkpoint": {}}}
        raise ValueError(kind)

    # ------------------------------------------------------------------ faults
    def _nan(self, batch: dict[str, torch.Tensor]) -> bool:
        for f in self.job.get("faults", []):
            kind = f["kind"]
            if kind == "data" and f["sample"] in batch["ids"].tolist():
                return True
            if f.get("rank") != self.rank or f.get("step") != self.step:
                continue
            if kind == "device" and str(f["device"]) == os.environ["FT_DEVICE_ID"]:
                return True
            if kind == "transient" and self.pass_no == 1:
                return True
        return False

    def _vanishing(self) -> bool:
        return any(f["kind"] == "vanishing" and f["rank"] == self.rank and f["step"] == self.step
                   and self.pass_no == 1 for f in self.job.get("faults", []))

    # ------------------------------------------------------------------ training.py
    def loss_func(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        machine = get_rerun_state_machine()
        loss = torch.nn.functional.mse_loss(self.model(batch["x"]), batch["y"])
        if self._nan(batch):
            loss = loss * float("nan")
        every = self.job.get("report_every", 1)
        if self.step % every == 0:
            machine.validate_result(result=loss, rejection_func=torch.isnan,
                                    message=NAN_MESSAGE, tolerance=0.0, fatal=True)
            machine.validate_result(
                result=loss,
                rejection_func=partial(machine.is_unexpectedly_large, threshold=1e6,
                                       context="loss"),
                message="Spiky loss", tolerance=0.0, fatal=False)
        if self._vanishing():
            machine.validate_result(result=loss, rejection_func=lambda _: True,
                                    message="first pass only", fatal=True)
        return loss

    def train_step(self) -> tuple[bool, bool, int]:
        machine = get_rerun_state_machine()
        record = {"iteration": self.step, "kind": "train", "passes": []}
        self.trace["steps"].append(record)
        self.pass_no = 0
        while machine.should_run_forward_backward(self.data_iterator):
            self.pass_no += 1
            self.optimizer.zero_grad()
            ids = []
            for _ in range(MICROBATCHES):
                batch = next(self.data_iterator)
                ids.extend(batch["ids"].tolist())
                (self.loss_func(batch) / MICROBATCHES).backward()
            for p in self.model.parameters():  # DDP's gradient all-reduce
                dist.all_reduce(p.grad)
                p.grad /= self.world
            record["passes"].append(ids)
        should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
        if should_exit:
            return should_checkpoint, should_exit, exit_code
        self.optimizer.step()
        record["trained"] = record["passes"][-1]
        return False, False, 0

    def dummy_train_step(self) -> None:
        machine = get_rerun_state_machine()
        record = {"iteration": self.step, "kind": "dummy", "passes": []}
        self.trace["steps"].append(record)
        while machine.should_run_forward_backward(self.data_iterator):
            ids = []
            for _ in range(MICROBATCHES):
                ids.extend(next(self.data_iterator)["ids"].tolist())
            record["passes"].append(ids)

    def train(self) -> int:
        machine = get_rerun_state_machine()
        iteration = self.iteration
        if machine.current_iteration != iteration:
            machine.current_iteration = iteration
        batch_size = self.world * MBS * MICROBATCHES
        exit_code = 0
        while iteration < self.spec["train_iters"]:
            self.step = iteration + 1
            if iteration + 1 in self.iterations_to_skip:
                self.dummy_train_step()
                iteration += 1
                self.consumed_train_samples += batch_size
                continue
            should_checkpoint, should_exit, exit_code = self.train_step()
            if should_checkpoint:
                self.save_checkpoint(iteration)
            if should_exit:
                break
            iteration += 1
            self.consumed_train_samples += batch_size
        self.trace["next_sample"] = self.data_iterator.iterable.next_sample
        self.trace["suspicious_device"] = machine.suspicious_device
        self.trace["first_iteration_complete"] = machine.first_iteration_complete
        self.trace["stats"] = dict(machine.last_stats_report)
        return exit_code

    def run(self) -> dict:
        self.parse_args()
        self.initialize()
        rerun_state_machine.add_diagnosis_listener(self.trace["events"].append)
        try:
            self.trace["exit_code"] = self.train()
        finally:
            rerun_state_machine.remove_diagnosis_listener(self.trace["events"].append)
            dist.barrier()  # leave together: a torn-down gloo peer aborts the other
            dist.destroy_process_group()
        return self.trace


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    handler = _Collect()
    logging.getLogger("rerun").addHandler(handler)
    logging.getLogger("rerun").setLevel(logging.WARNING)
    results: dict[str, list[dict]] = {}
    for name, scenario in spec["scenarios"].items():
        where = out / name
        where.mkdir(parents=True, exist_ok=True)
        results[name] = []
        for index, job in enumerate(scenario["jobs"]):
            handler.lines = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trace = Job(scenario, job, index, rank, world, where).run()
            trace["warnings"] = [str(w.message) for w in caught
                                 if "requires_grad" in str(w.message)]
            trace["rerun_log"] = handler.lines
            results[name].append(trace)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "scenarios": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
