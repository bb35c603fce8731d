"""Runs a rerun test's worker script as a fork of a process that imported torch once.

tests/rerun/test_rerun_multiprocess.py starts 18 workers (9 two-rank jobs); each imported
torch, torch.distributed and torch._dynamo (torch.optim imports it) itself, ~2 CPU seconds
of its ~2.3. A multiprocessing forkserver, started by the test module with ``PRELOAD``,
imports them once; each worker is a fork of it that becomes what a fresh
``python worker.py ARGS`` with that environment would be: its own session, its own
environment, argv and output file, the script run as ``__main__``, and the script's exit
code as the process's. The rerun state machine's globals are created by the script, as in a
fresh interpreter (the preload only imports its modules).
"""

from __future__ import annotations

import os
import runpy
import sys

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "rerun"]


def run_script(script: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """The target of the forked process (module-level: the forkserver imports it)."""
    os.setsid()  # like start_new_session: the test kills the whole session on a timeout
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    import torch

    # A fresh interpreter reads OMP_NUM_THREADS when torch is imported; here torch was
    # imported by the forkserver, so the same setting is applied now, before any work.
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
