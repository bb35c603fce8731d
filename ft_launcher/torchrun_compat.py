"""torchrun's options as torchrun reads them: ``PET_*`` defaults and option values. Pure.

torchrun (``torch.distributed.run``) takes the default of most options from an environment
variable ``PET_<NAME>`` (``NAME``: the option's long name, upper case, ``_`` for ``-``), and
the default of its on/off flags from ``PET_<NAME>`` read as an integer (0 = off, any other
integer = on). An option given on the command line beats its variable. Kubeflow's trainer
sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT`` and starts ``torchrun train.py``; ``ft_launcher train.py`` reads them the
same way. No torch import here: the launcher starts without it.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass

from ft_agent.config import ConfigError

# Options whose default torchrun reads from PET_<NAME> (its ``env`` action), by click name.
PET_VALUE_OPTIONS = (
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "max_restarts", "monitor_interval", "start_method", "event_log_handler", "role",
    "log_dir", "redirects", "tee", "local_ranks_filter", "duplicate_stdout_filters",
    "duplicate_stderr_filters", "node_rank", "master_addr", "master_port", "local_addr",
    "signals_to_handle", "shutdown_timeout",
)
# On/off flags whose default torchrun reads from PET_<NAME> as an integer (``check_env``).
PET_FLAG_OPTIONS = ("standalone", "module", "no_python", "run_path", "virtual_local_rank")
# torchrun's --logs-specs and --numa-binding have no PET_ variable.

START_METHODS = ("spawn", "fork", "forkserver")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
# The launcher's own signal handling when --signals-to-handle is not given.
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
# Signals a launcher cannot or must not catch for its workers' sake.
UNHANDLEABLE_SIGNALS = {"SIGKILL", "SIGSTOP", "SIGCHLD"}
ENV_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def pet_var(name: str) -> str:
    """The variable torchrun reads an option's default from: ``PET_NPROC_PER_NODE``."""
    return f"PET_{name.upper()}"


@dataclass(frozen=True)
class PetValue:
    """A default taken from the environment: the option, its variable, the raw text."""

    name: str
    var: str
    raw: str


def pet_defaults(environ: Mapping[str, str], given: set[str]) -> list[PetValue]:
    """The PET_* variables that set an option not given on the command line.

    As torchrun: a variable that is set counts even when empty (an empty value is a value).
    """
    out = []
    for name in (*PET_VALUE_OPTIONS, *PET_FLAG_OPTIONS):
        var = pet_var(name)
        if name not in given and var in environ:
            out.append(PetValue(name, var, environ[var]))
    return out


def parse_pet_flag(var: str, raw: str) -> bool:
    """A flag's PET_ variable, read as torchrun does: an integer, 0 = off, other = on."""
    try:
        return int(raw) != 0
    except ValueError:
        raise ConfigError(f"{var}: expected an integer (0 = off, 1 = on), as torchrun "
                          f"reads it, got {raw!r}") from None


def parse_filters(raw: str | None) -> list[str]:
    """torchrun's --duplicate-std*-filters: comma-separated, ``,,`` for a literal comma."""
    if not raw:
        return []
    marker = "\0"
    return [item.replace(marker, ",") for item in raw.replace(",,", marker).split(",")]


def parse_signals(source: str, raw: str) -> tuple[signal.Signals, ...]:
    """--signals-to-handle: signal names, comma-separated (``SIGTERM,SIGUSR1``)."""
    out = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        name = part.upper() if part.upper().startswith("SIG") else f"SIG{part.upper()}"
        sig = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if sig is None or name in UNHANDLEABLE_SIGNALS:
            raise ConfigError(f"{source}: {part!r} is not a signal the launcher can handle "
                              f"(e.g. SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1)")
        out.append(sig)
    if not out:
        raise ConfigError(f"{source}: expected signal names, e.g. SIGTERM,SIGINT, got {raw!r}")
    return tuple(dict.fromkeys(out))


# Signals handed to the workers while the job goes on (Slurm's warning before a time limit);
# every other handled signal stops the workers with itself, as SIGTERM does.
PASSED_ON_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def split_signals(handled: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(signals that stop the job, signals handed on) for LaunchConfig.signals_to_handle;
    None = the launcher's own: SIGTERM, SIGINT, SIGHUP stop it, SIGUSR1 is handed on."""
    if handled is None:
        return tuple(int(getattr(signal, n)) for n in DEFAULT_SIGNALS), (int(signal.SIGUSR1),)
    passed = tuple(int(s) for s in handled if s in PASSED_ON_SIGNALS)
    return tuple(int(s) for s in handled if s not in PASSED_ON_SIGNALS), passed


def shutdown_timeout_from_env(environ: Mapping[str, str]) -> float | None:
    """torchrun's fallback for --shutdown-timeout: TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
    raw = environ.get(ENV_SHUTDOWN_TIMEOUT)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{ENV_SHUTDOWN_TIMEOUT}: expected whole seconds >= 0, got {raw!r}")
    return float(value)


def warm_from_start_method(method: str) -> bool:
    """spawn: a fresh interpreter per worker (a cold start, as torchrun starts a script);
    fork and forkserver: workers forked from the node's zygote (warm restart)."""
    return method != "spawn"


# Options that name torch's own machinery: accepted, and what is done instead.
NOT_APPLIED = {
    "logs_specs": "--logs-specs names a torchrun.logs_specs plugin (a torch LogsSpecs "
                  "class); not loaded: worker logs go to RUN_DIR/logs, or --log-dir",
    "event_log_handler": "--event-log-handler names a torch.distributed.elastic events "
                         "handler; not used: the launcher's events go to "
                         "RUN_DIR/events.jsonl",
    "numa_binding": "--numa-binding is not applied: workers keep the launcher's CPU "
                    "affinity (bind the launcher with numactl or taskset to choose it)",
    "duplicate_stdout_filters": "--duplicate-stdout-filters is not applied: every worker's "
                                "output is kept whole in RUN_DIR/logs (grep it there)",
    "duplicate_stderr_filters": "--duplicate-stderr-filters is not applied: every worker's "
                                "output is kept whole in RUN_DIR/logs (grep it there)",
}


def not_applied(values: Mapping[str, object]) -> list[str]:
    """One warning per torch-only option that asks for something: what is done instead."""
    out = []
    for name, message in NOT_APPLIED.items():
        value = values.get(name)
        if name.startswith("duplicate_"):
            value = parse_filters(value) if isinstance(value, str) else value
        if name == "event_log_handler" and value == "null":
            value = None  # torchrun's default: no handler asked for
        if value:
            out.append(message)
    return out
