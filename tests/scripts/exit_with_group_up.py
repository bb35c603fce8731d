"""A gloo job whose rank 0 ends with a collective in flight and its group left up.

    exit_with_group_up.py OUT [--code N | --raise]

Rank 0 starts an all-reduce whose future has a Python callback (as a DDP communication
hook's does), has its own exit handler tell rank 1 to join it, and ends: ``sys.exit(N)``,
or an uncaught exception with ``--raise``. An object it holds takes a second to be torn
down at the interpreter's finalization. Rank 1 waits for the word, joins the all-reduce,
destroys its group and exits 0. So rank 0's collective completes, and its callback needs
the interpreter, while rank 0 exits: unless its group is destroyed before the interpreter
finalizes, rank 0 dies of SIGABRT ("terminate called without an active exception").

Each rank writes OUT/seen_<rank>.json before importing anything (what it found at start:
``PYTHONPATH``, the ``FT_*`` variable names, ``sys.path``, the loaded modules), and a call
of ``destroy_process_group`` after the script ended writes OUT/destroyed_<rank>. Run
without ``RANK`` (no launcher) it writes OUT/seen_plain.json and exits.
"""

import json
import os
import sys

SEEN = {"PYTHONPATH": os.environ.get("PYTHONPATH"),
        "ft_variables": sorted(k for k in os.environ if k.startswith("FT_COLD")),
        "sys_path": list(sys.path), "modules": sorted(sys.modules)}

import argparse  # noqa: E402 - after what the script saw at start
import atexit  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--code", type=int, default=0)
parser.add_argument("--raise", dest="fail", action="store_true")
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
rank_name = os.environ.get("RANK", "plain")
(args.out / f"seen_{rank_name}.json").write_text(json.dumps(SEEN))
if rank_name == "plain":
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
joined = args.out / "rank0_exiting"


class SlowTeardown:
    """Held by rank 0 to its end: its teardown at finalization lets the collective land."""

    def __del__(self, sleep=time.sleep):
        sleep(1.0)


total = torch.ones(1)
if rank == 1:
    deadline = time.monotonic() + 60
    while not joined.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.all_reduce(total)
    dist.destroy_process_group()
    sys.exit(0)

keep = SlowTeardown()
atexit.register(joined.touch)  # runs before anything registered earlier
dist.all_reduce(total, async_op=True).get_future().then(lambda fut: fut.value())
marker = args.out / "destroyed_0"


def watch(frame, event, _arg):
    if event == "call" and frame.f_code.co_name == "destroy_process_group":
        marker.write_text("called\n")


sys.setprofile(watch)
if args.fail:
    raise RuntimeError("rank 0 fails with its group up")
sys.exit(args.code)
