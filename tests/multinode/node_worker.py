"""Training loop for the multi-node tests: one gloo all-reduce per step, one line per step.

argv: OUT_DIR. Each step appends {"t", "node", "cycle", "round", "pid", "rank", "world",
"step", "sum", "total"} to OUT_DIR/steps.jsonl (one short write with O_APPEND: lines of
several ranks never mix). Rank 0 stops the job when OUT_DIR/stop exists; the decision travels
in the all-reduce, so every rank leaves at the same step. FAIL_RANK / FAIL_STEP: that global
rank exits 5 at that step, once per job (OUT_DIR/failed marks it done). STEP_S: pause per step
(default 0.05 s). GLOO_TIMEOUT_S: the process group's timeout (default 30 s).

Checkpoints (CKPT_EVERY=K): the training state is ``total``, the sum of the indices of the
steps applied, so a step counted twice (or lost) shows in it. Rank CKPT_RANK (default 0)
writes OUT_DIR/ckpt.json every K steps and at the end, and appends each write, with the
writer's identity (node, cycle, rendezvous round, pid), to OUT_DIR/ckpt_log.jsonl; a new
world resumes from rank 0's reading of ckpt.json. TOTAL_STEPS=N: the job ends after step N-1.
CKPT_NODE / PAUSE_NODE: the rank on that node (by its run directory's name) instead, while
the node is in the world (which rank a node gets is the rendezvous's choice).
PAUSE_RANK / PAUSE_STEP: that rank, once per job, stops between that step's all-reduce and its
writes (OUT_DIR/paused.json says so) until OUT_DIR/frozen exists (at most 150 s): the moment a
frozen node's worker must not resume into.

Snapshots (SNAPSHOT=1, with ``--ft-snapshot-every``): each rank snapshots ``total`` after
every step (iteration = the next step) and, in a new cycle, resumes from the iteration the
launcher chose when there is one (each step line then carries ``restored``).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient

out = Path(sys.argv[1])
client = RankMonitorClient()
client.init_workload_monitoring()
dist.init_process_group("gloo",
                        timeout=timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT_S", "30"))))
rank, world = dist.get_rank(), dist.get_world_size()
cycle = int(os.environ["FT_CYCLE"])
node = os.path.basename(os.environ["FT_RUN_DIR"])
step_s = float(os.environ.get("STEP_S", "0.05"))
fail = (os.environ.get("FAIL_RANK"), os.environ.get("FAIL_STEP", "10"))
ckpt_every = int(os.environ.get("CKPT_EVERY", "0"))
ckpt_rank = int(os.environ.get("CKPT_RANK", "0"))
total_steps = int(os.environ.get("TOTAL_STEPS", "0"))  # 0: until OUT_DIR/stop
pause = (os.environ.get("PAUSE_RANK"), os.environ.get("PAUSE_STEP"))


def rank_on(name: str | None, default: int | None) -> int | None:
    """The rank of this world on node ``name`` (every rank takes part), else ``default``."""
    if not name:
        return default
    mine = torch.zeros(world, dtype=torch.int64)
    mine[rank] = 1 if node == name else 0
    dist.all_reduce(mine)
    on = [r for r in range(world) if mine[r]]
    return on[0] if on else default


ckpt_rank = rank_on(os.environ.get("CKPT_NODE"), ckpt_rank)
if os.environ.get("PAUSE_NODE"):
    paused_rank = rank_on(os.environ["PAUSE_NODE"], None)
    pause = (None if paused_rank is None else str(paused_rank), pause[1])
me = {"node": node, "cycle": cycle, "round": int(os.environ.get("FT_RDZV_ROUND", "-1")),
      "pid": os.getpid()}
fd = os.open(out / "steps.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def append(path: Path, record: dict) -> None:
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(log_fd, (json.dumps(record) + "\n").encode())
    os.close(log_fd)


def save(step: int, total: int) -> None:
    record = {"t": time.time(), "step": step, "total": total, **me}
    append(out / "ckpt_log.jsonl", record)
    tmp = out / f"ckpt.json.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / "ckpt.json")


def resume() -> tuple[int, int]:
    """(step, total) of the checkpoint, as rank 0 read it (every rank starts there)."""
    got = torch.zeros(2, dtype=torch.int64)
    if rank == 0 and ckpt_every and (out / "ckpt.json").exists():
        ck = json.loads((out / "ckpt.json").read_text())
        got = torch.tensor([ck["step"], ck["total"]], dtype=torch.int64)
    dist.broadcast(got, 0)
    return int(got[0]), int(got[1])


def pause_here(step: int) -> None:
    if pause != (str(rank), str(step)) or (out / "paused.json").exists():
        return
    (out / "paused.json").write_text(json.dumps({"t": time.time(), "step": step, "rank": rank,
                                                 **me}))
    deadline = time.monotonic() + 150
    while not (out / "frozen").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


snapshots = os.environ.get("SNAPSHOT") == "1"
restored = client.restore() if snapshots else None
if restored is not None:
    step, total = restored[1], int(restored[0]["total"][0])
    me["restored"] = step
else:
    step, total = resume()
while total_steps == 0 or step < total_steps:
    stop = 1.0 if rank == 0 and (out / "stop").exists() else 0.0
    t = torch.tensor([float(rank + 1), stop])
    dist.all_reduce(t)
    total += step  # the step's update: applied once per step in the state
    pause_here(step)
    line = {"t": time.time(), **me, "rank": rank, "world": world, "step": step,
            "sum": t[0].item(), "total": total}
    os.write(fd, (json.dumps(line) + "\n").encode())
    client.send_heartbeat()
    if t[1].item() > 0:
        break
    if (str(rank), str(step)) == fail and world > 1 and not (out / "failed").exists():
        (out / "failed").touch()
        os._exit(5)  # sys.exit would tear the process group down mid-job: gloo aborts
    step += 1
    if snapshots:
        client.snapshot({"total": torch.tensor([total])}, step)
    if ckpt_every and rank == ckpt_rank and step % ckpt_every == 0:
        save(step, total)
    time.sleep(step_s)
if total_steps and ckpt_every and rank == ckpt_rank and step % ckpt_every:
    save(step, total)  # the final state
dist.barrier()
dist.destroy_process_group()
