"""A gloo job that never destroys its process group, then exits with ``--code``.

    leave_group.py OUT [--code N]

Before exiting, each rank profiles its own calls: a call of ``destroy_process_group`` (at
exit, by the launcher's warm worker) writes OUT/destroyed_<rank>.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--code", type=int, default=0)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.ones(1)
dist.all_reduce(total)
args.out.mkdir(parents=True, exist_ok=True)
marker = args.out / f"destroyed_{rank}"


def watch(frame, event, _arg):
    if event == "call" and frame.f_code.co_name == "destroy_process_group":
        marker.write_text(f"initialized={dist.is_initialized()}\n")


sys.setprofile(watch)
sys.exit(args.code)
