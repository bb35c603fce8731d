"""ft_agent: the in-process agent imported by training code.

Light on purpose: importing it loads neither click nor torch nor zmq; the ZeroMQ socket is
opened by ``RankMonitorClient.init_workload_monitoring()``.

NVRx code ports by changing ``import nvidia_resiliency_ext.fault_tolerance as ft`` to
``import ft_agent as ft``: the names below are NVRx's, with NVRx's meaning, except
``snapshot_stateful`` and ``restore_stateful`` (in-memory snapshots of a dict of objects
with ``state_dict()`` / ``load_state_dict()``, see ``ft_agent.stateful``).
"""

from ft_agent.client import RankMonitorClient, RankMonitorClientError, get_client
from ft_agent.config import ConfigError, FaultToleranceConfig
from ft_agent.nvrx_types import (
    CURRENT_TIMEOUTS_STATE_KEY,
    HeartbeatTimeouts,
    SectionTimeouts,
    WorkloadAction,
    WorkloadControlRequest,
)
from ft_agent.stateful import restore_stateful, snapshot_stateful

__all__ = [
    "CURRENT_TIMEOUTS_STATE_KEY",
    "ConfigError",
    "FaultToleranceConfig",
    "HeartbeatTimeouts",
    "RankMonitorClient",
    "RankMonitorClientError",
    "SectionTimeouts",
    "WorkloadAction",
    "WorkloadControlRequest",
    "get_client",
    "restore_stateful",
    "snapshot_stateful",
]
