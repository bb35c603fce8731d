"""A light training step for the node-loss benchmarks: heartbeat, gloo barrier, one line.

argv: OUT_DIR. Every step appends {"t", "node", "pid", "wstart", "rank", "world", "round",
"step"} to OUT_DIR/steps.jsonl (one short O_APPEND write: lines of several ranks never mix).
``t`` and ``wstart`` (this process's start, taken before torch is imported) are wall-clock
times (``time.time()``) so the driver compares them with its own kill time; every process
runs on this one machine, so they share one clock. ``node`` is NODE_NAME (the driver sets
it per launcher). ``round`` is FT_CYCLE under ft_launcher, TORCHELASTIC_RESTART_COUNT under
torchrun. STEP_S: pause per step (default 0.1 s); GLOO_TIMEOUT_S: the process group's
timeout (default 30 s), the same under every launcher.

The worker never ends by itself: the driver stops every process by pid. No model, no
tensors beyond the barrier's: 17 of these must fit beside each other on a 2-core machine.
"""

import time

WSTART = time.time()  # before the imports: a new worker is recognised by it

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

from ft_agent import RankMonitorClient  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    client = RankMonitorClient()  # a cheap no-op without FT_ENDPOINT (torchrun)
    client.init_workload_monitoring()
    timeout = float(os.environ.get("GLOO_TIMEOUT_S", "30"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    rnd = int(os.environ.get("FT_CYCLE", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    node = os.environ.get("NODE_NAME", "?")
    step_s = float(os.environ.get("STEP_S", "0.1"))
    fd = os.open(out / "steps.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    step = 0
    while True:
        dist.barrier()
        line = {"t": time.time(), "node": node, "pid": os.getpid(), "wstart": WSTART,
                "rank": rank, "world": world, "round": rnd, "step": step}
        os.write(fd, (json.dumps(line) + "\n").encode())
        client.send_heartbeat()
        step += 1
        time.sleep(step_s)


if __name__ == "__main__":
    main()
