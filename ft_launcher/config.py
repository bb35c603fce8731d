"""Launcher configuration: dataclasses, parsing of option values and the YAML file.

Precedence: an option given on the command line beats the YAML file (``--ft-cfg-path``),
which beats the built-in default. The CLI tells which options were given explicitly.
"""

from __future__ import annotations

import dataclasses
import difflib
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user mistake in options or the YAML file; the message names the option or key."""


@dataclass
class FaultToleranceConfig:
    """Hang detection, policy and fault-injection settings (NVRx key names where shared).

    A timeout of None is off, except the two heartbeat timeouts, where None means "learn":
    the monitor arms them once it has observed enough intervals (see monitor.py).
    """

    initial_rank_heartbeat_timeout: float | None = None
    rank_heartbeat_timeout: float | None = None
    rank_section_timeouts: dict[str, float | None] = field(default_factory=dict)
    rank_out_of_section_timeout: float | None = None
    safety_factor: float = 5.0
    rank_termination_signal: int = int(signal.SIGKILL)
    workload_check_interval: float | None = None  # accepted for NVRx files; unused
    state_path: str | None = None
    simulated_fault: str | None = None
    skip_bad_iterations: bool = False
    max_no_progress_cycles: int | None = None
    checkpoint_iteration_file: str | None = None
    warm_restart: bool = False
    preload: list[str] = field(default_factory=lambda: ["torch"])


# YAML keys accepted under ``fault_tolerance:``, each mapped to a parser.
def _parse_timeout(name: str, value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "off")):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected seconds or 'none', got {value!r}") from None
    if seconds <= 0:
        raise ConfigError(f"{name}: must be positive, got {value!r}")
    return seconds


def parse_section_timeouts(name: str, value: Any) -> dict[str, float | None]:
    """``"step:30,ckpt:600"`` or a mapping -> {section: seconds or None}."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for part in value.split(","):
            section, sep, seconds = part.strip().partition(":")
            if not sep or not section:
                raise ConfigError(f"{name}: expected name:seconds[,name:seconds], got {part!r}")
            items.append((section.strip(), seconds.strip()))
    else:
        raise ConfigError(f"{name}: expected a mapping or name:seconds list, got {value!r}")
    return {str(k): _parse_timeout(f"{name}[{k}]", v) for k, v in items}


def parse_signal(name: str, value: Any) -> int:
    """``SIGKILL``, ``KILL`` or ``9`` -> 9."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        text = str(value).strip().upper()
        if text.isdigit():
            number = int(text)
        else:
            try:
                number = int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])
            except KeyError:
                raise ConfigError(f"{name}: unknown signal {value!r}") from None
    if number not in {int(s) for s in signal.Signals}:
        raise ConfigError(f"{name}: unknown signal {value!r}")
    return number


def _parse_positive_float(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"{name}: must be positive, got {value!r}")
    return number


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def _parse_optional_int(name: str, value: Any) -> int | None:
    if value is None or str(value).lower() == "none":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{name}: must be at least 1, got {value!r}")
    return number


def _parse_optional_str(name: str, value: Any) -> str | None:
    return None if value is None else str(value)


def _parse_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{name}: expected a comma-separated list of module names, got {value!r}")


FT_PARSERS = {
    "initial_rank_heartbeat_timeout": _parse_timeout,
    "rank_heartbeat_timeout": _parse_timeout,
    "rank_section_timeouts": parse_section_timeouts,
    "rank_out_of_section_timeout": _parse_timeout,
    "safety_factor": _parse_positive_float,
    "rank_termination_signal": parse_signal,
    "workload_check_interval": _parse_positive_float,
    "state_path": _parse_optional_str,
    "simulated_fault": _parse_optional_str,
    "skip_bad_iterations": _parse_bool,
    "max_no_progress_cycles": _parse_optional_int,
    "checkpoint_iteration_file": _parse_optional_str,
    "warm_restart": _parse_bool,
    "preload": _parse_list,
}
assert set(FT_PARSERS) == {f.name for f in dataclasses.fields(FaultToleranceConfig)}


def parse_ft_value(key: str, value: Any, source: str) -> Any:
    """Parse one fault-tolerance setting; errors name ``source`` (an option or YAML key)."""
    return FT_PARSERS[key](source, value)


def load_yaml_section(path: str) -> dict[str, Any]:
    """Read ``fault_tolerance:`` from a YAML file, parsed; unknown keys are an error."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--ft-cfg-path: cannot read {path}: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--ft-cfg-path: {path} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--ft-cfg-path: {path}: expected a mapping at the top level")
    unknown_top = set(doc) - {"fault_tolerance"}
    if unknown_top:
        raise ConfigError(
            f"--ft-cfg-path: {path}: unknown top-level key(s) {sorted(unknown_top)}; "
            "settings go under 'fault_tolerance:'"
        )
    section = doc.get("fault_tolerance") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"--ft-cfg-path: {path}: 'fault_tolerance' must be a mapping")
    parsed = {}
    for key, value in section.items():
        if key not in FT_PARSERS:
            close = difflib.get_close_matches(str(key), FT_PARSERS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key fault_tolerance.{key}{hint}")
        parsed[key] = parse_ft_value(key, value, f"{path}: fault_tolerance.{key}")
    return parsed


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
    role: str = "default"
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1
