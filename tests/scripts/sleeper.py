"""Connects to the monitor, heartbeats, and sleeps until killed.

argv[1] == "ignore-term": ignore SIGTERM, so only SIGKILL ends it.
Writes its pid to FT_RUN_DIR/pids/rank_<r> once running.
"""

import os
import signal
import sys
import time
from pathlib import Path

from ft_agent import RankMonitorClient

if len(sys.argv) > 1 and sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
client = RankMonitorClient()
client.init_workload_monitoring()
pids = Path(os.environ["FT_RUN_DIR"]) / "pids"
pids.mkdir(exist_ok=True)
(pids / f"rank_{os.environ['RANK']}").write_text(str(os.getpid()))
while True:
    client.send_heartbeat()
    time.sleep(0.05)
