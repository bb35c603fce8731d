"""A worker with no torch for the many-node benchmarks: heartbeat and one line per step.

argv: OUT_DIR. The same step lines as ``node_step_worker.py`` ({"t", "node", "pid",
"wstart", "rank", "world", "round", "step"}, one O_APPEND write each to OUT_DIR/steps.jsonl),
but no process group and no collective: ``rank`` and ``world`` are read from RANK and
WORLD_SIZE, which the launcher sets from its round. A node therefore learns of another
node's loss only from the launcher's rendezvous (the keep-alive expiry), never from a
collective that fails: the benchmark measures the control plane alone.

The first line is written as soon as ft_agent has said hello, before the first pause, so
"the worker runs" is dated by that line. STEP_S: pause per step (default 1 s). The first
line also carries ``torch_imported`` (False, checked: 64 of these must fit beside 64
launchers on a 2-core machine). The worker never ends by itself: the driver stops every
process by pid.
"""

import time

WSTART = time.time()  # before the imports: a new worker is recognised by it

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from ft_agent import RankMonitorClient  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    client = RankMonitorClient()
    client.init_workload_monitoring()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rnd = int(os.environ.get("FT_CYCLE", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    node = os.environ.get("NODE_NAME", "?")
    step_s = float(os.environ.get("STEP_S", "1.0"))
    fd = os.open(out / "steps.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    step = 0
    while True:
        line = {"t": time.time(), "node": node, "pid": os.getpid(), "wstart": WSTART,
                "rank": rank, "world": world, "round": rnd, "step": step}
        if step == 0:
            line["torch_imported"] = "torch" in sys.modules
        os.write(fd, (json.dumps(line) + "\n").encode())
        client.send_heartbeat()
        step += 1
        time.sleep(step_s)


if __name__ == "__main__":
    main()
