"""A training step of fixed work over a large state, for scripts/bench/snapshot_overhead.py.

Each rank holds ``--mb`` MB of float32 state (20 tensors, like a model's parameters) on
``--device`` (cpu, or cuda: the rank's GPU, shared when ranks outnumber GPUs). A step does
``--work`` rounds of a ``--size`` square matmul (the compute, waited for on a GPU),
updates every state tensor in place (the optimizer's pass over the parameters),
all-reduces a small tensor (the collective that keeps the ranks in step) and offers a
snapshot of the state (``snapshot()`` does nothing when the launcher keeps no snapshots).
``--wait-s`` adds a sleep after the compute: a GPU step's host thread waiting for the
device, which leaves its core to other work. Rank 0 writes each step's wall time to
``--out`` as JSON, with its process's CPU time and its training thread's.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient

TENSORS = 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--work", type=int, required=True, help="matmul rounds per step")
    p.add_argument("--size", type=int, default=256, help="the matmul's side")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--wait-s", type=float, default=0.0, help="sleep after the compute")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo")
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
    per = args.mb * 2**20 // 4 // TENSORS
    state = {f"layer{i}": torch.randn(per, device=device) for i in range(TENSORS)}
    a = torch.randn(args.size, args.size, device=device)
    flag = torch.zeros(1)
    step_s = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        x = a
        for _ in range(args.work):
            x = torch.tanh(x @ a)
        if args.wait_s > 0:
            time.sleep(args.wait_s)
        for t in state.values():
            t.mul_(0.999)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's end, as an optimizer's .item() would
        dist.all_reduce(flag)
        ft.snapshot(state, step)
        ft.send_heartbeat()
        step_s.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_s": step_s, "cpu_s": time.process_time(),
                       "main_cpu_s": time.thread_time()}, f)
    ft.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
