#!/usr/bin/env python3
"""Host the c10d rendezvous store of a several-node job in the batch shell, not in a launcher,
and coordinate its rounds from there.

Started by ``ft_sbatch.sh`` on the batch node before ``srun``; the launchers are told
``--rdzv-conf is_host=false`` and connect to it as clients. Why: with the c10d backend the
store otherwise lives inside whichever launcher started first on the endpoint's host, and
that launcher coordinates the rounds. When it leaves the job (its health check failed, it
was excluded, it died), the store goes with it and every other node loses the rendezvous,
so no spare could ever take a node's place. Here the store and the coordinator live as long
as the batch script, that is the job.

Usage: ``rdzv_store.py PORT READY_FILE MIN:MAX RDZV_ID`` (the launchers' ``--nnodes`` and
``--rdzv-id``). It writes READY_FILE once the store listens, then waits for SIGTERM (the
wrapper stops it by pid after the launch). Exit 1, with one line on stderr, when it cannot
listen (the port is taken): the wrapper then lets a launcher host the store as before.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def serve(port: int, ready: Path, min_nodes: int, max_nodes: int, run_id: str) -> int:
    """Listen on ``port`` (every interface) and coordinate until SIGTERM; the exit status."""
    # Imported here: the usage error needs no torch.
    from ft_launcher.nodes.place import serve_store
    from ft_launcher.nodes.rendezvous import RendezvousError

    try:
        store, coordinator = serve_store(port, run_id, min_nodes, max_nodes)
    except (RendezvousError, RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        print(f"rdzv_store.py: cannot listen on port {port}: {first[0]}", file=sys.stderr)
        return 1
    tmp = ready.with_name(ready.name + ".tmp")
    tmp.write_text(f"{os.getpid()} {port}\n")
    tmp.rename(ready)  # the wrapper sees the file whole or not at all
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    coordinator.stop()
    del store
    return 0


def main(argv: list[str]) -> int:
    # Blocked before anything else: a TERM during torch's import must still end us cleanly
    # through sigwait, and the wrapper's USR1 (time limit near) is not for the store.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    sizes = argv[2].split(":") if len(argv) == 4 else []
    if len(argv) != 4 or not argv[0].isdigit() or not 0 < int(argv[0]) < 65536 \
            or len(sizes) != 2 or not all(x.isdigit() and int(x) > 0 for x in sizes) \
            or int(sizes[0]) > int(sizes[1]) or not argv[3]:
        print("usage: rdzv_store.py PORT READY_FILE MIN:MAX RDZV_ID (PORT 1-65535, "
              "0 < MIN <= MAX)", file=sys.stderr)
        return 2
    return serve(int(argv[0]), Path(argv[1]), int(sizes[0]), int(sizes[1]), argv[3])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
