"""Cycle 0: every rank ignores SIGTERM and keeps heartbeating until killed; later cycles
heartbeat briefly and exit 0."""

import os
import signal
import time

from ft_agent import RankMonitorClient

client = RankMonitorClient()
client.init_workload_monitoring()
if os.environ["FT_CYCLE"] == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        client.send_heartbeat()
        time.sleep(0.05)
for _ in range(10):
    client.send_heartbeat()
    time.sleep(0.05)
client.shutdown_workload_monitoring()
