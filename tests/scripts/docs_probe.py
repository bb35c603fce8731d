"""What a worker gets, for tests/test_docs.py: writes its environment to
OUT/cycle_<c>_rank_<r>.json (OUT is argv[1], outside the run directory, so the run
directory holds only what the launcher made). With ``--hang``, every rank of the first cycle
sends one heartbeat and then sleeps, to be judged hung: its stacks are dumped and the group
restarted. Imports no torch."""

import json
import os
import sys
import time
from pathlib import Path

from ft_agent import RankMonitorClient

out = Path(sys.argv[1])
cycle, rank = os.environ["FT_CYCLE"], os.environ["RANK"]
(out / f"cycle_{cycle}_rank_{rank}.json").write_text(json.dumps(dict(os.environ)))
client = RankMonitorClient()
client.init_workload_monitoring()
client.send_heartbeat()
if "--hang" in sys.argv and cycle == "0":
    time.sleep(120)  # the launcher kills it long before
client.shutdown_workload_monitoring()
