"""Hang detection: the liveness model, timeouts in force, the monitor's socket, blame, stacks,
NCCL traces, the response to a verdict."""
