"""Host the rerun state machine in a training process and tell the launcher its verdicts.

One call sets the machine up with what the launcher assigned (the device identity comes from
``FT_DEVICE_ID``, the tracker file lives in ``FT_RUN_DIR``) and forwards every rejected
result and verdict as a ``diagnosis`` message, so the launcher knows why before the process
exits with 16 or 17. Imports torch (through ``rerun``) only when called.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ft_agent.client import RankMonitorClient, get_client

TRACKER_FILE = "rerun_rejected.jsonl"


def default_tracker_file() -> str | None:
    """``FT_RUN_DIR/rerun_rejected.jsonl`` under ft_launcher, else None (no tracker)."""
    run_dir = os.environ.get("FT_RUN_DIR")
    return str(Path(run_dir) / TRACKER_FILE) if run_dir else None


def setup_rerun_state_machine(
    mode: Any = "validate_results",
    state_save_func: Any = None,
    state_restore_func: Any = None,
    error_injector: Any = None,
    result_rejected_tracker_filename: str | None = None,
    client: RankMonitorClient | None = None,
) -> Any:
    """Initialise the process-wide rerun state machine and forward its verdicts.

    ``mode`` is a ``rerun.RerunMode`` or its value ("disabled", "validate_results",
    "report_determinism_stats"). The tracker file defaults to the run directory's. The
    client is connected first if it is not already (a no-op outside ft_launcher). Returns
    the machine (``rerun.get_rerun_state_machine()``).
    """
    import rerun

    client = client or get_client()
    client.init_workload_monitoring()
    tracker = result_rejected_tracker_filename or default_tracker_file()
    rerun.initialize_rerun_state_machine(
        state_save_func=state_save_func,
        state_restore_func=state_restore_func,
        mode=rerun.RerunMode(mode),
        error_injector=error_injector,
        result_rejected_tracker_filename=tracker,
    )
    rerun.add_diagnosis_listener(lambda event: client.send_diagnosis(**event))
    return rerun.get_rerun_state_machine()
