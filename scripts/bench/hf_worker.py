"""examples/hf_trainer.py with the benchmark's step clock, for scripts/bench/hf_trainer.py.

    hf_worker.py --bench-events FILE [examples/hf_trainer.py's arguments]

The clock is a TrainerCallback of the benchmark's own, not ft_agent: under every launcher
the training is the same HF script. It appends one JSON line per record to FILE (each line
one ``write`` on a file opened with O_APPEND, so the ranks' lines never interleave), in
the records scripts/bench/runner.py reads:

- ``{"ev": "pid", ...}`` as the process starts, before the imports, so the driver can
  signal it;
- ``{"ev": "first_step", "step": N, ...}`` after the first optimizer step of the process;
- ``{"ev": "step", "step": N, ...}`` after every optimizer step (the first one included).

Every record has ``t`` (unix time), ``rank``, ``pid`` and ``cycle``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"


class Clock:
    """Appends records to the benchmark's events file."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank = int(os.environ.get("RANK", "0"))
        self.cycle = int(os.environ.get("FT_CYCLE") or os.environ.get(
            "TORCHELASTIC_RESTART_COUNT") or 0)

    def __call__(self, ev: str, **fields: Any) -> None:
        record = {"ev": ev, "t": time.time(), "rank": self.rank, "pid": os.getpid(),
                  "cycle": self.cycle, **fields}
        os.write(self.fd, (json.dumps(record) + "\n").encode())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench-events", required=True)
    args, rest = p.parse_known_args()
    clock = Clock(args.bench_events)
    clock("pid")
    # After the pid record: the imports take seconds. By path: this folder has a
    # hf_trainer.py of its own (the driver).
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from transformers import TrainerCallback  # noqa: PLC0415

    class StepClock(TrainerCallback):
        first = True

        def on_step_end(self, args, state, control, **kwargs):
            if self.first:
                self.first = False
                clock("first_step", step=state.global_step)
            clock("step", step=state.global_step)

    return example.main(rest, callbacks=[StepClock()])


if __name__ == "__main__":
    sys.exit(main())
