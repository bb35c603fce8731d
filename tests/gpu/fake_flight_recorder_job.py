"""A CPU worker that answers flight-recorder dump requests the way torch's NCCL process group
does, for testing the launcher's side without a GPU (test helper; no torch import).

torch (ProcessGroupNCCL's heartbeat monitor thread) creates the FIFO
``$TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe``, opens it non-blocking for reading and polls
it; when something was written it writes its dump to ``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``
(``TORCH_FR_DUMP_TEMP_FILE`` first). This script does the same from a thread, then heartbeats
a few times and, in the first cycle, hangs in ``hang_here`` until it is killed. The dump's
content is a marker, not torch's pickle.
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from ft_agent import RankMonitorClient  # noqa: E402

MARKER = b"fake flight recorder dump of rank "


def serve_dump_requests(pipe_stem: str, dump_prefix: str, rank: int) -> None:
    path = f"{pipe_stem}{rank}.pipe"
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.mkfifo(path, 0o666)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    while True:
        try:
            asked = os.read(fd, 128)
        except BlockingIOError:
            asked = b""
        if asked:
            with open(f"{dump_prefix}{rank}", "wb") as f:
                f.write(MARKER + str(rank).encode())
            print(f"rank {rank}: dump written", flush=True)
        time.sleep(0.2)


def hang_here() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    rank = int(os.environ["RANK"])
    cycle = int(os.environ.get("FT_CYCLE", "0"))
    pipe_stem = os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or \
        os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    print(f"rank {rank} cycle {cycle}: pipe {pipe_stem} dump {prefix}", flush=True)
    if pipe_stem and prefix:
        threading.Thread(target=serve_dump_requests, args=(pipe_stem, prefix, rank),
                         daemon=True).start()
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    for _ in range(5):
        ft.send_heartbeat()
        time.sleep(0.1)
    if cycle == 0:
        hang_here()
    ft.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
