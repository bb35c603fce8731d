"""Launcher configuration: dataclasses, parsing of option values and the YAML file.

Precedence: an option given on the command line beats the YAML file (``--ft-cfg-path``),
which beats the built-in default. The CLI tells which options were given explicitly.
The NVRx-shared settings, their value checks and the YAML reader live in
``ft_agent.config`` (training code reads the same file); this module adds the launcher's own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_agent import config as agent_config
from ft_agent.config import (  # noqa: F401 - re-exported for the launcher's modules
    DEFAULT_INITIAL_TIMEOUT_S,
    DEFAULT_MIN_LEARNED_TIMEOUT_S,
    ConfigError,
    NotApplicable,
    Parser,
    parse_int,
    parse_number,
    parse_section_timeouts,
    parse_signal,
)
from ft_agent.config import parse_bool as _parse_bool
from ft_agent.config import parse_optional_str as _parse_optional_str
from ft_agent.config import parse_timeout as _parse_timeout  # noqa: F401

DEFAULT_PRELOAD = ("torch", "torch._dynamo")


@dataclass
class FaultToleranceConfig(agent_config.FaultToleranceConfig):
    """Hang detection (NVRx's settings, inherited), policy and fault-injection settings.

    A timeout of None is off, except the two heartbeat timeouts, where None means "learn":
    the monitor arms them once it has observed enough intervals (see monitor.py).
    """

    state_path: str | None = None
    simulated_fault: str | None = None
    skip_bad_iterations: bool = False
    max_no_progress_cycles: int | None = None
    checkpoint_iteration_file: str | None = None
    warm_restart: bool = True  # docs/warm-restart.md: --no-ft-warm-restart turns it off
    # What a DDP script imports by its first step: torch, then torch._dynamo, which DDP's
    # constructor imports (-X importtime on examples/train_ddp.py, 2 CPU ranks: 2.58 s of
    # the 2.62 s its rank imports beyond torch). Both fork-safe: no thread, file or socket.
    preload: list[str] = field(default_factory=lambda: list(DEFAULT_PRELOAD))
    # The zygote also imports what the job's warm workers imported (warm/learned_preloads.py).
    preload_learn: bool = True
    # Single node: each cycle's TCPStore is hosted by a process that listens before the
    # workers start (TORCHELASTIC_USE_AGENT_STORE=True), even without warm restart. Off by
    # default: its torch import cost a 2-core machine 1.2 s of start-up (docs/warm-restart.md).
    agent_store: bool = False
    # Stragglers (ft_launcher/stragglers/straggler.py): score = a rank's median time in this section
    # over the other ranks' medians, each over the last `window` steps.
    straggler_threshold: float = 1.3
    straggler_action: str = "report"  # report | restart | exclude
    straggler_window: int = 12
    straggler_section: str = "compute"
    metrics_port: int | None = None  # Prometheus metrics (ft_launcher.observe.metrics); None = off
    metrics_addr: str = "127.0.0.1"
    status_interval: float = 60.0  # seconds between status lines; 0 = off
    # Node health checks (ft_launcher/nodes/health.py), run before every rendezvous.
    health_checks: list[str] = field(default_factory=list)  # shell commands
    health_check_timeout: float = 30.0  # seconds, per check
    min_free_space: int = 100 * 2**20  # bytes free in the run directory; 0 = no minimum
    # In-memory snapshots (ft_launcher/snapshots/): "auto" (the frequency the ranks agree on,
    # under snapshot_overhead of the step time), every N steps ("5") or seconds ("30s");
    # None = off. Memory per node in bytes, None = half of the shared memory free at start.
    snapshot_every: str | None = "auto"
    snapshot_memory: int | None = None
    snapshot_replicas: int = 0
    snapshot_overhead: float = 0.02

    @classmethod
    def parsers(cls) -> dict[str, Parser]:
        return FT_PARSERS


def _parse_positive_float(name: str, value: Any) -> float:
    return parse_number(name, value, high=float("1e12"))


def _parse_optional_int(name: str, value: Any) -> int | None:
    # NVRx turns progress tracking off with 0; here that is None.
    if value is None or str(value).strip().lower() in ("none", "0"):
        return None
    return parse_int(name, value, low=1)


STRAGGLER_ACTIONS = ("report", "restart", "exclude")


def _parse_straggler_threshold(name: str, value: Any) -> float:
    return parse_number(name, value, low=1.0, high=1000.0)  # > 1: 1.3 = 30 % slower


def _parse_straggler_window(name: str, value: Any) -> int:
    return parse_int(name, value, low=3, high=100_000)  # a median of fewer says nothing


def _parse_straggler_action(name: str, value: Any) -> str:
    text = str(value).strip().lower()
    if text not in STRAGGLER_ACTIONS:
        raise ConfigError(f"{name}: expected one of {', '.join(STRAGGLER_ACTIONS)}, "
                          f"got {value!r}")
    return text


def _parse_section_name(name: str, value: Any) -> str:
    text = _parse_optional_str(name, value)
    if not text or not text.strip() or len(text) > 256:
        raise ConfigError(f"{name}: expected a section name (1-256 characters), got {value!r}")
    return text


def _parse_preload(name: str, value: Any) -> list[str]:
    """Module names, comma-separated or a list: they replace the default preloads, or with
    a leading ``+`` (``+mypkg,other``) come after them."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise ConfigError(f"{name}: expected a comma-separated list of module names, "
                          f"got {value!r}")
    add = bool(items) and items[0].startswith("+")
    if add:
        items[0] = items[0][1:].strip()
    names = [v for v in items if v]
    bad = [v for v in names if not all(part.isidentifier() for part in v.split("."))]
    if bad:
        raise ConfigError(f"{name}: {bad[0]!r} is not a module name (expected e.g. "
                          "torch,torch._dynamo, or +mypkg to add to the defaults)")
    return [*DEFAULT_PRELOAD, *names] if add else names


def _parse_port(name: str, value: Any) -> int | None:
    if value is None or str(value).strip().lower() in ("none", "off"):
        return None
    return parse_int(name, value, low=1, high=65535)


def _parse_addr(name: str, value: Any) -> str:
    text = _parse_optional_str(name, value)
    if not text or len(text) > 255 or any(c.isspace() for c in text):
        raise ConfigError(f"{name}: expected an address to bind (e.g. 127.0.0.1), "
                          f"got {value!r}")
    return text


def _parse_interval(name: str, value: Any) -> float:
    return parse_number(name, value, low=0.0, high=float("1e9"), low_inclusive=True)


def _parse_commands(name: str, value: Any) -> list[str]:
    """Shell commands: one string, or a list of them (repeated option, YAML list)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"{name}: expected a shell command or a list of them, got {value!r}")
    for cmd in items:
        if not cmd.strip() or len(cmd) > 4096 or "\0" in cmd:
            raise ConfigError(f"{name}: expected a command of 1-4096 characters, got {cmd!r}")
    return list(items)


SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
              "mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40,
              "tib": 2**40}


def _parse_size(name: str, value: Any) -> int:
    """Bytes: ``1048576``, ``100MB``, ``2G`` (binary units; 0 = no minimum)."""
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    if unit not in SIZE_UNITS or not number:
        raise ConfigError(f"{name}: expected bytes or a size such as 500MB or 2GB, "
                          f"got {value!r}")
    size = parse_number(name, number, low=0.0, high=2.0**60, low_inclusive=True)
    return int(size * SIZE_UNITS[unit])


def _parse_snapshot_every(name: str, value: Any) -> str | None:
    """``auto``, steps (``5``) or seconds (``30s``) between snapshots; ``off``/``0``/none =
    off."""
    text = "" if value is None else str(value).strip().lower()
    if text in ("", "none", "off", "0"):
        return None
    if text == "auto":
        return text
    if text.endswith("s"):
        seconds = parse_number(name, text[:-1], low=0.0, high=1e6)
        return f"{seconds:g}s"
    try:
        return str(parse_int(name, text, low=1, high=10**9))
    except ConfigError:
        raise ConfigError(f"{name}: expected auto, steps (e.g. 5), seconds (e.g. 30s) or "
                          f"off, got {value!r}") from None


def _parse_overhead(name: str, value: Any) -> float:
    """A share of the step time: ``2%`` or ``0.02``, above 0 and at most 100 %."""
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        share = parse_number(name, text[:-1] if percent else text, low=0.0, high=100.0)
    except ConfigError:
        share = -1.0
    share = share / 100 if percent else share
    if not 0 < share <= 1:
        raise ConfigError(f"{name}: expected a share of the step time above 0 and at most "
                          f"100% (e.g. 2% or 0.02), got {value!r}")
    return share


def _parse_snapshot_memory(name: str, value: Any) -> int | None:
    text = "" if value is None else str(value).strip().lower()
    if text in ("", "none", "auto"):
        return None
    size = _parse_size(name, value)
    if size <= 0:
        raise ConfigError(f"{name}: expected a size above 0 (or auto), got {value!r}")
    return size


def _parse_replicas(name: str, value: Any) -> int:
    return parse_int(name, value, low=0, high=64)


FT_PARSERS: dict[str, Parser] = {
    **agent_config.BASE_PARSERS,
    "state_path": _parse_optional_str,
    "simulated_fault": _parse_optional_str,
    "skip_bad_iterations": _parse_bool,
    "max_no_progress_cycles": _parse_optional_int,
    "checkpoint_iteration_file": _parse_optional_str,
    "warm_restart": _parse_bool,
    "agent_store": _parse_bool,
    "preload": _parse_preload,
    "preload_learn": _parse_bool,
    "straggler_threshold": _parse_straggler_threshold,
    "straggler_action": _parse_straggler_action,
    "straggler_window": _parse_straggler_window,
    "straggler_section": _parse_section_name,
    "metrics_port": _parse_port,
    "metrics_addr": _parse_addr,
    "status_interval": _parse_interval,
    "health_checks": _parse_commands,
    "health_check_timeout": _parse_positive_float,
    "min_free_space": _parse_size,
    "snapshot_every": _parse_snapshot_every,
    "snapshot_memory": _parse_snapshot_memory,
    "snapshot_replicas": _parse_replicas,
    "snapshot_overhead": _parse_overhead,
}
assert set(FT_PARSERS) == {f.name for f in dataclasses.fields(FaultToleranceConfig)} - {
    "configured"}


def parse_ft_value(key: str, value: Any, source: str) -> Any:
    """Parse one fault-tolerance setting; errors name ``source`` (an option or YAML key)."""
    return FT_PARSERS[key](source, value)


def load_yaml_settings(path: str) -> tuple[dict[str, Any], list[NotApplicable]]:
    """``fault_tolerance:`` of a YAML file, parsed, and the NVRx keys that do nothing here.
    A key unknown to both is an error with a "did you mean" hint."""
    return agent_config.parse_settings(agent_config.read_yaml_section(path), FT_PARSERS, path)


def load_yaml_section(path: str) -> dict[str, Any]:
    """The parsed settings of a YAML file (warning once per NVRx key not applicable)."""
    values, ignored = load_yaml_settings(path)
    agent_config.warn_not_applicable(ignored)
    return values


@dataclass
class LaunchConfig:
    """Everything the supervisor needs for one job on one node."""

    entrypoint: list[str]  # argv prefix: [python, -u, script] or [python, -u, -m, mod]
    script_args: list[str]
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    monitor_interval: float = 0.1
    run_id: str = ""
    run_dir: Path = Path("ft_runs")
    log_dir: Path | None = None
    redirects: dict[int, int] = field(default_factory=dict)  # local rank -> 0..3
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: set[int] | None = None
    term_timeout: float = 30.0
    workers_stop_timeout: float = 15.0
    # A rank done training (goodbye) that has not exited this long after a peer's clean
    # exit is stuck in its teardown (hang/exit_watch.py); 0 = wait forever.
    workers_exit_timeout: float = 30.0
    role: str = "default"  # ROLE_NAME in the workers' environment (torchrun's --role)
    # torchrun's --local-addr: the address this node advertises in a dynamic
    # rendezvous (its workers' MASTER_ADDR when it is group rank 0); None = found by route.
    local_addr: str | None = None
    # torchrun's --virtual-local-rank: LOCAL_RANK=0 for every worker, CUDA_VISIBLE_DEVICES
    # its one device (worker_env).
    virtual_local_rank: bool = False
    # torchrun's --signals-to-handle; None = the launcher's own set (SIGTERM, SIGINT,
    # SIGHUP; SIGUSR1 passed through).
    signals_to_handle: tuple[int, ...] | None = None
    start_method: str | None = None  # torchrun's --start-method as given (ft.warm_restart)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
