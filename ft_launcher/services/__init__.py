"""What a cycle only calls: the job's services (snapshots, stragglers, the warm standby
pool, the status line, NCCL traces), each behind the one seam of ``seam.CycleService``.
``job.for_job`` builds the job's list; the cycle imports none of them."""
