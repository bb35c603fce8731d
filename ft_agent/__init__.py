"""ft_agent: the in-process agent imported by training code.

Light on purpose: importing it loads neither click nor torch nor zmq; the ZeroMQ socket is
opened by ``RankMonitorClient.init_workload_monitoring()``.
"""

from ft_agent.client import RankMonitorClient, RankMonitorClientError, get_client

__all__ = ["RankMonitorClient", "RankMonitorClientError", "get_client"]
