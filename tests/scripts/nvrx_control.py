"""NVRx's client surface without torch: readiness errors, timeouts views and a workload
control request, as NVRx's workload-control test worker uses them.

Usage: nvrx_control.py OUTPUT_DIR exclude|shutdown
Rank 0 asks for the action with a ``WorkloadControlRequest`` and exits 123 (as NVRx's
worker does); the other ranks heartbeat until they are stopped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import ft_agent as ft  # was: import nvidia_resiliency_ext.fault_tolerance as ft

out, action = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
ft_cli = ft.RankMonitorClient()
seen: dict = {"before_init": str(ft_cli.hb_timeouts), "initialized_before": ft_cli.is_initialized}
ft_cli.init_workload_monitoring(num_warmup_iters=3)
seen["initialized"] = ft_cli.is_initialized
try:
    ft_cli.calculate_and_set_hb_timeouts()  # no interval seen yet
    seen["not_ready"] = "no error"
except ft.RankMonitorClientError as exc:
    seen["not_ready"] = f"RankMonitorClientError: {exc}"
seen["skip_if_not_ready"] = ft_cli.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
# The monitor calculates from every rank's intervals: no rank heartbeats before all checked.
(out / f"checked_{rank}").touch()
deadline = time.monotonic() + 30
world = int(os.environ["WORLD_SIZE"])
while not all((out / f"checked_{r}").exists() for r in range(world)):
    assert time.monotonic() < deadline, "other ranks never checked"
    time.sleep(0.02)
for _ in range(5):
    ft_cli.send_heartbeat()
    time.sleep(0.05)
seen["calculated"] = ft_cli.calculate_and_set_hb_timeouts()
seen["hb_timeouts"] = str(ft_cli.hb_timeouts)
seen["section_timeouts"] = str(ft_cli.section_timeouts)
seen["state"] = ft_cli.state_dict()
(out / f"control_rank_{rank}.json").write_text(json.dumps(seen))
if rank == 0:
    what = {"exclude": ft.WorkloadAction.ExcludeThisNode,
            "shutdown": ft.WorkloadAction.ShutdownWorkload}[action]
    ft_cli.send_workload_control_request(ft.WorkloadControlRequest(what, f"test {action} req"))
    ft_cli.shutdown_workload_monitoring()
    sys.exit(123)
while True:
    ft_cli.send_heartbeat()
    time.sleep(0.05)
