"""Forms a gloo process group, all-reduces, and (rank 1) SIGKILLs itself until cycle N.

Proves that every new cycle's process group forms, however often the group is restarted.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

crashes = int(sys.argv[1])
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
assert t.item() == sum(range(1, dist.get_world_size() + 1)), t
print(f"cycle {cycle} rank {dist.get_rank()} all_reduce ok", flush=True)
if cycle < crashes and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
