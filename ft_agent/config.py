"""Fault-tolerance settings under NVRx's key names: value checks and the YAML file.

``FaultToleranceConfig`` here holds what NVRx's class of the same name holds for hang
detection (timeouts, safety factor, termination signal, log level), so training code can
build one from an NVRx YAML file and read its timeouts. The launcher extends it with its
own settings (``ft_launcher.config``). Every value from a flag or a file is checked here:
numbers must be finite and in range, and an error names the option or key.

NVRx keys and flags that have no meaning here (NIC checks, GPU memory reclaim, log server,
attribution service, ...) are listed in ``NVRX_NOT_APPLICABLE`` and
``NVRX_LAUNCHER_FLAGS_NOT_APPLICABLE`` with the reason; they are accepted with one warning
each, so an NVRx file runs unchanged. Pure: no click, no torch; PyYAML is imported only
when a file is read.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("ft_agent.config")

# The initial timeout used when some heartbeat or section timeout is set but the initial one
# is not: a rank that hangs before its first heartbeat (imports, process-group setup) is
# judged too. NVRx 0.4 used one hour; ten minutes covers a cold start of a large job.
DEFAULT_INITIAL_TIMEOUT_S = 600.0
# The floor under every learned, calculated or loaded timeout (issue 11: a learned 1e-9 s
# killed healthy ranks). A minute survives a checkpoint pause that was never observed.
DEFAULT_MIN_LEARNED_TIMEOUT_S = 60.0
# Largest accepted number of seconds (30 days, as the monitor's limit); 'none' = off.
MAX_SECONDS = 30 * 24 * 3600.0
MAX_SAFETY_FACTOR = 1000.0
MAX_YAML_BYTES = 1 << 20
# As many named sections as the monitor keeps apart, and as long a name.
MAX_SECTIONS = 256
MAX_SECTION_NAME_LEN = 128
NONE_WORDS = ("none", "null", "off", "")
HEARTBEAT_KEYS = ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout")
SECTION_KEYS = ("rank_section_timeouts", "rank_out_of_section_timeout")


class ConfigError(ValueError):
    """A user mistake in options or the YAML file; the message names the option or key."""


Parser = Callable[[str, Any], Any]

# -- value parsers: parse(name, value); ``name`` is the option or key named in errors -----


def parse_number(name: str, value: Any, low: float = 0.0, high: float = MAX_SECONDS,
                 low_inclusive: bool = False) -> float:
    """A finite number in (low, high] (or [low, high]); NaN, inf, bools and text fail."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{name}: must be a finite number, got {value!r}")
    if number < low or (number == low and not low_inclusive) or number > high:
        above = f"at least {low:g}" if low_inclusive else f"greater than {low:g}"
        raise ConfigError(f"{name}: must be {above} and at most {high:.0f}, got {value!r}")
    return number


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS)


def parse_timeout(name: str, value: Any) -> float | None:
    """Seconds (finite, positive, at most MAX_SECONDS) or None for 'none'/'null'/'off'."""
    if _is_none(value):
        return None
    return parse_number(name, value)


def parse_section_timeouts(name: str, value: Any) -> dict[str, float | None]:
    """``"step:30,ckpt:600"`` or a mapping -> {section: seconds or None}."""
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for part in value.split(","):
            section, sep, seconds = part.strip().partition(":")
            if not sep or not section.strip():
                raise ConfigError(f"{name}: expected name:seconds[,name:seconds], got {part!r}")
            items.append((section.strip(), seconds.strip()))
    else:
        raise ConfigError(f"{name}: expected a mapping or name:seconds list, got {value!r}")
    if len(items) > MAX_SECTIONS:
        raise ConfigError(f"{name}: {len(items)} sections, more than {MAX_SECTIONS}")
    for section, _ in items:
        if not isinstance(section, str) or not 0 < len(section) <= MAX_SECTION_NAME_LEN \
                or not section.isprintable():
            raise ConfigError(f"{name}: section name {str(section)[:40]!r} is not 1 to "
                              f"{MAX_SECTION_NAME_LEN} printable characters")
    return {k: parse_timeout(f"{name}[{k}]", v) for k, v in items}


def parse_signal(name: str, value: Any) -> signal.Signals:
    """``SIGKILL``, ``KILL`` or ``9`` -> signal.SIGKILL."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        text = str(value).strip().upper()
        if text.isdigit():
            number = int(text)
        else:
            try:
                return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
            except KeyError:
                raise ConfigError(f"{name}: unknown signal {value!r}") from None
    try:
        return signal.Signals(number)
    except ValueError:
        raise ConfigError(f"{name}: unknown signal {value!r}") from None


_LEVELS = {"DEBUG": logging.DEBUG, "DBG": logging.DEBUG, "INFO": logging.INFO,
           "WARNING": logging.WARNING, "WARN": logging.WARNING, "ERROR": logging.ERROR,
           "CRITICAL": logging.CRITICAL, "FATAL": logging.CRITICAL}


def parse_log_level(name: str, value: Any) -> int:
    """``DEBUG``/``INFO``/``WARNING``/``ERROR``/``CRITICAL`` or 10..50 (NVRx's values)."""
    if isinstance(value, str) and value.strip().upper() in _LEVELS:
        return _LEVELS[value.strip().upper()]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and \
            logging.DEBUG <= value <= logging.CRITICAL:
        return value
    raise ConfigError(f"{name}: expected DEBUG, INFO, WARNING, ERROR, CRITICAL or 10..50, "
                      f"got {value!r}")


def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def parse_int(name: str, value: Any, low: int = 0, high: int = 1 << 31) -> int:
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    try:
        number = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if not low <= number <= high:
        raise ConfigError(f"{name}: must be in [{low}, {high}], got {value!r}")
    return number


def parse_optional_str(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name}: expected text, got {value!r}")
    return str(value)


def _safety_factor(name: str, value: Any) -> float:
    # Below 1 a calculated timeout would be shorter than an interval already observed.
    return parse_number(name, value, low=1.0, high=MAX_SAFETY_FACTOR, low_inclusive=True)


# -- the configuration ---------------------------------------------------------------------

C = TypeVar("C", bound="FaultToleranceConfig")


@dataclass
class FaultToleranceConfig:
    """Hang-detection settings with NVRx's names and meaning (seconds; None = off).

    The two heartbeat timeouts at None mean "learn": the launcher's monitor arms them from
    observed intervals. When any heartbeat or section timeout is set and the initial one is
    not, the initial one is ``DEFAULT_INITIAL_TIMEOUT_S`` (``from_values``/``from_yaml_file``).
    ``configured`` names the settings the user gave (flag or file), so a default can be told
    from a user value: a learned timeout never lowers a configured one unless
    ``learned_timeouts_override`` is set.
    """

    initial_rank_heartbeat_timeout: float | None = None
    rank_heartbeat_timeout: float | None = None
    rank_section_timeouts: dict[str, float | None] = field(default_factory=dict)
    rank_out_of_section_timeout: float | None = None
    safety_factor: float = 5.0
    rank_termination_signal: signal.Signals = signal.SIGKILL
    log_level: int = logging.INFO
    min_learned_timeout: float = DEFAULT_MIN_LEARNED_TIMEOUT_S
    learned_timeouts_override: bool = False
    configured: frozenset[str] = frozenset()

    @classmethod
    def parsers(cls) -> Mapping[str, Parser]:
        """Setting name -> parser, for every setting of this class."""
        return BASE_PARSERS

    @classmethod
    def from_values(cls: type[C], values: Mapping[str, Any]) -> C:
        """A config from parsed settings; every key given counts as configured."""
        values = dict(values)
        configured = frozenset(values)
        if "initial_rank_heartbeat_timeout" not in values and timeouts_set(values):
            values["initial_rank_heartbeat_timeout"] = DEFAULT_INITIAL_TIMEOUT_S
        return cls(**values, configured=configured)

    @classmethod
    def from_kwargs(cls: type[C], ignore_not_recognized: bool = True, **kwargs: Any) -> C:
        """NVRx's constructor from raw settings: values are parsed and checked."""
        values, ignored = parse_settings(kwargs, cls.parsers(), None,
                                         strict=not ignore_not_recognized)
        warn_not_applicable(ignored)
        return cls.from_values(values)

    @classmethod
    def from_yaml_file(cls: type[C], cfg_path: str, ignore_not_recognized: bool = True) -> C:
        """Read the ``fault_tolerance:`` section of a YAML file, as NVRx does (at the top
        level or nested). Keys NVRx knows but that do not apply here are accepted with one
        warning each; other unknown keys are ignored, or an error with a "did you mean"
        hint when ``ignore_not_recognized`` is False. Raises ConfigError naming the file."""
        raw = read_yaml_section(cfg_path)
        values, ignored = parse_settings(raw, cls.parsers(), cfg_path,
                                         strict=not ignore_not_recognized)
        warn_not_applicable(ignored)
        return cls.from_values(values)

    def to_yaml_file(self, cfg_path: str) -> None:
        """Write the settings under ``fault_tolerance:`` (readable by from_yaml_file)."""
        import yaml

        doc = {}
        for f in dataclasses.fields(self):
            if f.name in self.parsers():
                doc[f.name] = getattr(self, f.name)
        doc["rank_termination_signal"] = signal.Signals(self.rank_termination_signal).name
        doc["log_level"] = logging.getLevelName(self.log_level)
        Path(cfg_path).write_text(yaml.safe_dump({"fault_tolerance": doc}, sort_keys=False))


def timeouts_set(values: Mapping[str, Any]) -> bool:
    """True when a heartbeat, section or out-of-section timeout has a value."""
    sections = values.get("rank_section_timeouts") or {}
    return (values.get("rank_heartbeat_timeout") is not None
            or values.get("rank_out_of_section_timeout") is not None
            or any(v is not None for v in sections.values()))


BASE_PARSERS: dict[str, Parser] = {
    "initial_rank_heartbeat_timeout": parse_timeout,
    "rank_heartbeat_timeout": parse_timeout,
    "rank_section_timeouts": parse_section_timeouts,
    "rank_out_of_section_timeout": parse_timeout,
    "safety_factor": _safety_factor,
    "rank_termination_signal": parse_signal,
    "log_level": parse_log_level,
    "min_learned_timeout": parse_number,
    "learned_timeouts_override": parse_bool,
}
assert set(BASE_PARSERS) == {f.name for f in dataclasses.fields(FaultToleranceConfig)} - {
    "configured"}


# -- NVRx settings that do not apply here ----------------------------------------------------

def _any_text(name: str, value: Any) -> Any:
    return parse_optional_str(name, value)


def _seconds(name: str, value: Any) -> Any:
    return None if _is_none(value) else parse_number(name, value, low_inclusive=True)


def _count(name: str, value: Any) -> Any:
    return None if _is_none(value) else parse_int(name, value, low=-1)


_NIC = "no NIC link monitoring or health check runs here"
_GPU_MEM = "the launcher does not wait for GPU memory to be freed between cycles"
_ATTRIBUTION = "there is no attribution service; hang verdicts and stacks are in RUN_DIR"
_LOG_SERVER = ("there is no log server: each worker's output goes to "
               "RUN_DIR/logs/cycle_N/rank_R.log (--log-dir moves them)")

# NVRx 0.4-0.7 ``fault_tolerance`` keys (and their --ft-* flags) with no meaning here:
# key -> (value check, why not applicable).
NVRX_NOT_APPLICABLE: dict[str, tuple[Parser, str]] = {
    "workload_check_interval": (_seconds, "hang detection is deadline-driven: the monitor "
                                "sleeps until the next deadline instead of polling every "
                                "N seconds"),
    "node_health_check_interval": (_seconds, "no node health-check service runs here"),
    "restart_check_interval": (_seconds, "NVRx's layered restart protocol is not used; the "
                               "launcher restarts the worker group itself"),
    "enable_nic_monitor": (parse_bool, _NIC),
    "enable_nic_healthcheck": (parse_bool, _NIC),
    "pci_topo_file": (_any_text, _NIC),
    "link_down_path_template": (_any_text, _NIC),
    "link_state_path_template": (_any_text, _NIC),
    "enable_dist_storage_healthcheck": (parse_bool, "no built-in storage health check runs "
                                        "here"),
    "storage_healthcheck_path": (_any_text, "no built-in storage health check runs here"),
    "skip_section_response": (parse_bool, "heartbeats and section messages are always "
                              "fire-and-forget here"),
    "use_infra_group_rank": (parse_bool, "group ranks come from the rendezvous "
                             "(--node-rank with the static backend)"),
    "segment": (_count, "no NVLink-domain segment-aware rank assignment here"),
    "numa_bind_strict": (parse_bool, "the launcher does not bind workers to NUMA nodes"),
    "gpu_memory_reclaim_timeout": (_seconds, _GPU_MEM),
    "gpu_memory_tolerance_mb": (_seconds, _GPU_MEM),
    "gpu_memory_poll_interval": (_seconds, _GPU_MEM),
    "check_remaining_processes": (parse_bool, "each worker's whole process group is killed "
                                  "at teardown"),
    "min_progress_iterations": (_count, "any increase of the checkpointed iteration counts "
                                "as progress"),
    "install_exception_hook": (parse_bool, "tracebacks are kept in the per-rank logs; "
                               "sys.excepthook is not replaced"),
    "num_warmup_iterations": (_count, "timeouts apply from the first step; use "
                              "initial_rank_heartbeat_timeout or an 'init' section for slow "
                              "starts"),
    "attribution_endpoint": (_any_text, _ATTRIBUTION),
    "attribution_stop_action": (_any_text, _ATTRIBUTION),
    "attribution_export_url": (_any_text, _ATTRIBUTION),
    "cycle_info_dir": (_any_text, "cycles are recorded in RUN_DIR/events.jsonl and "
                       "summary.json"),
}

# NVRx launcher flags without a ``fault_tolerance`` key: flag name (without --ft-) ->
# (value check, why not applicable, the value that is this launcher's behaviour anyway).
NVRX_LAUNCHER_FLAGS_NOT_APPLICABLE: dict[str, tuple[Parser, str, Any]] = {
    "restart-policy": (_any_text, "the launcher restarts the whole group when any rank "
                       "fails (NVRx's any-failed)", "any-failed"),
    "rdzv-impl": (_any_text, "torch's rendezvous is used (--rdzv-backend static|c10d)", None),
    "node-health-check-endpoint": (_any_text, "no node health-check service runs here", None),
    "no-restart-exit-code": (_any_text, "exit codes 16, 17 and 18 carry the policy (see "
                             "'Exit codes')", None),
    "cycle-info-job-id": (_any_text, "cycles are recorded in RUN_DIR/events.jsonl", None),
    "per-cycle-applog-prefix": (_any_text, _LOG_SERVER, None),
    "nvrx-logfile": (_any_text, _LOG_SERVER, None),
    "enable-log-server": (_any_text, _LOG_SERVER, None),
    "log-server-port": (_any_text, _LOG_SERVER, None),
    "log-aggregator-count": (_any_text, _LOG_SERVER, None),
    "log-leaf-max-queue-chunks": (_any_text, _LOG_SERVER, None),
    "log-server-log-prefix": (_any_text, _LOG_SERVER, None),
    "log-server-graceful-shutdown-timeout": (_seconds, _LOG_SERVER, None),
    "attribution-startup-timeout": (_seconds, _ATTRIBUTION, None),
    "attribution-compute-timeout": (_seconds, _ATTRIBUTION, None),
    "attribution-llm-api-key-file": (_any_text, _ATTRIBUTION, None),
    "attribution-llm-base-url": (_any_text, _ATTRIBUTION, None),
    "attribution-llm-model": (_any_text, _ATTRIBUTION, None),
    "attribution-analysis-backend": (_any_text, _ATTRIBUTION, None),
    "attribution-log-level": (_any_text, _ATTRIBUTION, None),
}

# Settings that match this launcher's behaviour when given this value: accepted silently.
_ALREADY_SO = {"skip_section_response": True}


@dataclass(frozen=True)
class NotApplicable:
    """An NVRx setting accepted and ignored: where it came from and why it does nothing."""

    key: str
    source: str
    reason: str

    def message(self) -> str:
        return (f"{self.source}: NVRx setting '{self.key}' is not applicable here "
                f"({self.reason}); ignored")


def check_not_applicable(key: str, value: Any, source: str) -> NotApplicable | None:
    """Check an NVRx-only value; None when it asks for what happens here anyway."""
    if key in NVRX_NOT_APPLICABLE:
        check, reason = NVRX_NOT_APPLICABLE[key]
        already = _ALREADY_SO.get(key)
    else:
        check, reason, already = NVRX_LAUNCHER_FLAGS_NOT_APPLICABLE[key]
    parsed = check(source, value)
    if already is not None and parsed == already:
        return None
    return NotApplicable(key, source, reason)


def warn_not_applicable(items: Iterable[NotApplicable]) -> None:
    """One warning per NVRx setting that does nothing here (the first source named)."""
    seen = set()
    for item in items:
        if item.key not in seen:
            seen.add(item.key)
            log.warning("%s", item.message())


def parse_settings(raw: Mapping[Any, Any], parsers: Mapping[str, Parser],
                   path: str | None = None, strict: bool = True,
                   ) -> tuple[dict[str, Any], list[NotApplicable]]:
    """Parse raw settings (from the YAML file ``path``, or keyword arguments when None):
    known keys -> values, NVRx-only keys -> checked and listed as not applicable, other
    keys -> an error with a "did you mean" hint (or skipped when not ``strict``)."""

    def source(key: str) -> str:
        return f"{path}: fault_tolerance.{key}" if path is not None else key

    values: dict[str, Any] = {}
    ignored: list[NotApplicable] = []
    for raw_key, value in raw.items():
        key = str(raw_key)
        if key in parsers:
            values[key] = parsers[key](source(key), value)
        elif key in NVRX_NOT_APPLICABLE:
            item = check_not_applicable(key, value, source(key))
            if item is not None:
                ignored.append(item)
        elif strict:
            known = [*parsers, *NVRX_NOT_APPLICABLE]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            where = f"{path}: unknown key fault_tolerance." if path else "unknown setting "
            raise ConfigError(f"{where}{key}{hint}")
    return values, ignored


def _find_section(doc: Any, depth: int = 0) -> Any:
    """The value of the first ``fault_tolerance`` key, top level first (as NVRx)."""
    if depth > 32:
        return None
    if isinstance(doc, dict):
        if "fault_tolerance" in doc:
            return doc["fault_tolerance"]
        children: Iterable[Any] = doc.values()
    elif isinstance(doc, list):
        children = doc
    else:
        return None
    for child in children:
        found = _find_section(child, depth + 1)
        if found is not None:
            return found
    return None


def read_yaml_section(path: str) -> dict[str, Any]:
    """The raw ``fault_tolerance:`` mapping of a YAML file; ConfigError naming the file for
    anything else (unreadable, not UTF-8, not YAML, too large, no such section)."""
    import yaml

    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_YAML_BYTES} bytes; not a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{path}: not valid YAML: {detail}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'fault_tolerance:' section, got "
                          f"{type(doc).__name__}")
    section = _find_section(doc)
    if section is None and "fault_tolerance" not in doc:
        close = difflib.get_close_matches("fault_tolerance", [str(k) for k in doc], n=1)
        hint = f" (did you mean 'fault_tolerance' for '{close[0]}'?)" if close else ""
        raise ConfigError(f"{path}: no 'fault_tolerance:' section; unknown top-level key(s) "
                          f"{sorted(str(k) for k in doc)}{hint}")
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: 'fault_tolerance' must be a mapping of settings")
    return section
