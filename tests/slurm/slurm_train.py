"""A tiny stand-in for a training script, run by ft_launcher inside the Slurm test jobs.

Every run appends "<SLURMD_NODENAME> <SLURM_RESTART_COUNT>" to STATE_DIR/runs.txt, then:

- ``first-node-16``: exits 16 on the node where the job first ran, 0 on any other node
  (so the test holds whichever node the scheduler picks first).
- ``exit --code N``: exits N.
- ``exit-on --node NAME --code N``: exits N on node NAME, 0 elsewhere.
- ``usr1``: the USR1 contract: installs a SIGUSR1 handler, says it is ready
  (STATE_DIR/ready and ready.<node>), "trains" until USR1 arrives, then writes
  STATE_DIR/ckpt and exits 0. A later run that finds the checkpoint resumes, and finishes at once.
- ``hold``: says it is ready (STATE_DIR/ready and ready.<node>) and sleeps until a signal
  ends it.
- ``hold-first-run``: ``hold`` on the job's first run; a requeued run (SLURM_RESTART_COUNT
  set) exits 0 at once.
- ``hold-until-killed``: ``hold`` on runs that start before STATE_DIR/killed exists (the test
  writes it just before it kills a node); later runs exit 0 at once.

``--linger S`` waits S seconds before exiting. Two-node tests need it: ft_launcher has no
exit barrier yet, so a node whose workers finish at once shuts the c10d rendezvous down
while the other node may still be completing the same round (it then fails with
"rendezvous ... failed: ").
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["first-node-16", "exit", "exit-on", "usr1", "hold",
                                    "hold-first-run", "hold-until-killed"])
    p.add_argument("state_dir", type=Path)
    p.add_argument("--code", type=int, default=0)
    p.add_argument("--node", default="")
    p.add_argument("--linger", type=float, default=0.0)
    a = p.parse_args()
    code = run(a)
    time.sleep(a.linger)
    return code


def run(a: argparse.Namespace) -> int:
    """Run one mode; returns the exit code."""
    node = os.environ.get("SLURMD_NODENAME", "?")
    with open(a.state_dir / "runs.txt", "a") as f:
        f.write(f"{node} {os.environ.get('SLURM_RESTART_COUNT', 'unset')}\n")
    print(f"training on {node}, mode {a.mode}", flush=True)

    if a.mode == "first-node-16":
        first = a.state_dir / "first_node"
        if not first.exists():
            first.write_text(node)
        return 16 if first.read_text() == node else 0
    if a.mode == "exit":
        return a.code
    if a.mode == "exit-on":
        return a.code if node == a.node else 0
    if a.mode == "usr1":
        return usr1(a.state_dir, node)
    if a.mode == "hold-first-run" and "SLURM_RESTART_COUNT" in os.environ:
        return 0
    if a.mode == "hold-until-killed" and (a.state_dir / "killed").exists():
        return 0
    (a.state_dir / f"ready.{node}").write_text(str(os.getpid()))
    (a.state_dir / "ready").write_text(str(os.getpid()))
    time.sleep(120)  # ended by a signal; the test's deadline is far shorter
    return 3


def usr1(state_dir: Path, node: str) -> int:
    """Checkpoint and exit 0 on SIGUSR1: what ft_sbatch.sh expects before a time limit."""
    ckpt = state_dir / "ckpt"
    if ckpt.exists():
        print(f"resumed from step {ckpt.read_text()}; done", flush=True)
        return 0
    got: list[int] = []
    # install the handler before saying "ready": SIGUSR1's default action kills
    signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    (state_dir / f"ready.{node}").write_text(str(os.getpid()))
    (state_dir / "ready").write_text(str(os.getpid()))
    step = 0
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        step += 1
        time.sleep(0.02)
    if not got:
        return 5  # USR1 never came: the test fails on this code
    tmp = state_dir / f"ckpt.tmp.{node}"  # one per node: two-node jobs share state_dir
    tmp.write_text(str(step))
    tmp.rename(ckpt)  # a checkpoint is either whole or absent
    print(f"USR1: checkpoint at step {step}, exiting 0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
