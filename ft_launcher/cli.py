"""``ft_launcher``: torchrun-compatible command line plus fault-tolerance options."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ft_agent import config as agent_config
from ft_launcher import torchrun_compat
from ft_launcher.config import (
    DEFAULT_INITIAL_TIMEOUT_S,
    DEFAULT_MIN_LEARNED_TIMEOUT_S,
    FT_PARSERS,
    ConfigError,
    FaultToleranceConfig,
    LaunchConfig,
    NotApplicable,
    load_yaml_settings,
    parse_ft_value,
)

log = logging.getLogger("ft_launcher")


def _parse_nnodes(value: str, source: str = "--nnodes") -> tuple[int, int]:
    lo, sep, hi = str(value).partition(":")
    try:
        nodes = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ConfigError(f"{source}: expected N or MIN:MAX, got {value!r}") from None
    if nodes[0] < 1 or nodes[1] < nodes[0]:
        raise ConfigError(f"{source}: expected 1 <= MIN <= MAX, got {value!r}")
    return nodes


def _parse_per_rank(name: str, value: str | None, nproc: int) -> dict[int, int]:
    """torchrun's ``-r/-t``: ``3`` for every local rank or ``0:3,1:1`` per rank."""
    if not value:
        return {}
    try:
        if ":" not in value:
            return {r: _std(int(value), name) for r in range(nproc)}
        out = {}
        for part in value.split(","):
            rank, _, std = part.partition(":")
            out[int(rank)] = _std(int(std), name)
        return out
    except ValueError:
        raise ConfigError(f"{name}: expected 0-3 or local_rank:0-3,..., got {value!r}") from None


def _std(value: int, name: str) -> int:
    if value not in range(4):
        raise ConfigError(f"{name}: stream selector must be 0 (none) to 3 (both), got {value}")
    return value


def _parse_kv(name: str, value: str | None) -> dict[str, str]:
    if not value:
        return {}
    out = {}
    for part in value.split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{name}: expected key=value[,key=value], got {part!r}")
        out[key.strip()] = val.strip()
    return out


def _entrypoint(script: str, module: bool, no_python: bool) -> list[str]:
    if module and no_python:
        raise ConfigError("-m/--module and --no-python cannot be used together")
    if no_python:
        resolved = shutil.which(script)
        if resolved is None:
            raise ConfigError(f"training program {script!r} not found or not executable")
        return [script]
    if module:
        return [sys.executable, "-u", "-m", script]
    if not Path(script).is_file():
        raise ConfigError(f"training script {script!r} not found")
    return [sys.executable, "-u", script]


def _default_run_id() -> str:
    return os.environ.get("SLURM_JOB_ID") or f"{time.strftime('%Y%m%d-%H%M%S')}-" \
        f"{uuid.uuid4().hex[:6]}"


# Fault-tolerance options: (option, config key, help). Parsed by config.parse_ft_value.
FT_OPTIONS = [
    ("--ft-initial-rank-heartbeat-timeout", "initial_rank_heartbeat_timeout",
     "Seconds from a worker's spawn to its first heartbeat or section ('none' = learn). "
     f"Defaults to {DEFAULT_INITIAL_TIMEOUT_S:.0f} when any heartbeat or section timeout is "
     "set; give 'none' to keep it off then."),
    ("--ft-rank-heartbeat-timeout", "rank_heartbeat_timeout",
     "Seconds allowed between heartbeats ('none' = learn from observed intervals)."),
    ("--ft-rank-section-timeouts", "rank_section_timeouts",
     "Per-section timeouts, e.g. 'step:30,checkpoint:600'."),
    ("--ft-rank-out-of-section-timeout", "rank_out_of_section_timeout",
     "Seconds allowed outside any section once sections are used ('none' = off)."),
    ("--ft-safety-factor", "safety_factor",
     "Calculated timeout = factor x longest observed interval [5.0]."),
    ("--ft-rank-termination-signal", "rank_termination_signal",
     "Signal sent to a hung rank [SIGKILL]."),
    ("--ft-min-learned-timeout", "min_learned_timeout",
     "Floor under every learned, calculated or loaded timeout, in seconds "
     f"[{DEFAULT_MIN_LEARNED_TIMEOUT_S:.0f}]."),
    ("--ft-learned-timeouts-override", "learned_timeouts_override",
     "Let a learned or calculated timeout replace a timeout you configured, lower or "
     "higher (without it a configured value is never lowered)."),
    ("--ft-log-level", "log_level",
     "The launcher's log level: DEBUG, INFO, WARNING, ERROR (NVRx's log_level) [INFO]."),
    ("--ft-state-path", "state_path",
     "Learned timeouts file, reusable by later jobs [RUN_DIR/ft_state.json]."),
    ("--ft-simulated-fault", "simulated_fault",
     "Inject a fault: TYPE[:key=value,...], TYPE rank_killed|rank_hung|random|rank_exit|"
     "rank_slow, keys base_delay, rand_delay, rank, cycles (N, A-B, all), seed, code "
     "(rank_exit), factor and duration (rank_slow: 1/factor speed for duration s). "
     "base_delay counts from the moment every rank is training (first heartbeat, section "
     "or progress report); for a script that never talks to ft_agent, from the spawn, "
     "imports included."),
    ("--ft-skip-bad-iterations", "skip_bad_iterations",
     "On a validation failure that reproduces on other hardware, restart and skip it."),
    ("--ft-max-no-progress-cycles", "max_no_progress_cycles",
     "Stop with exit 18 after this many cycles without checkpoint progress."),
    ("--ft-checkpoint-iteration-file", "checkpoint_iteration_file",
     "File holding the last checkpointed iteration (written by the training)."),
    ("--ft-warm-restart/--no-ft-warm-restart", "warm_restart",
     "Start workers from standbys with the preloads imported, forked from one zygote per "
     "node, for the first cycle and every restart, without a fresh import [on]."),
    ("--ft-preload", "preload", "Modules the zygote imports for the standby workers, "
     "comma-separated; they replace the defaults, or with a leading + come after them "
     "(+mypkg) [torch,torch._dynamo]."),
    ("--ft-preload-learn/--no-ft-preload-learn", "preload_learn",
     "Also preload what the job's warm workers import (installed modules, not the "
     "script's own), learned while the job runs and kept in the state file [on]."),
    ("--ft-agent-store/--no-ft-agent-store", "agent_store",
     "One node: host each cycle's TCPStore in a process listening before the workers "
     "start, so no rank waits out the store client's retry back-off (warm restart "
     "always does) [off]."),
    ("--ft-straggler-threshold", "straggler_threshold",
     "A rank whose median section time is this many times the other ranks' is a "
     "straggler (> 1) [1.3]."),
    ("--ft-straggler-window", "straggler_window",
     "Steps behind each median; nothing is decided on fewer [12]."),
    ("--ft-straggler-section", "straggler_section",
     "Section timed for stragglers: around compute, outside collectives [compute]."),
    ("--ft-straggler-action", "straggler_action",
     "On a straggler: report (events only), restart the group, or exclude (stop; requeue "
     "without its host) [report]."),
    ("--ft-metrics-port", "metrics_port",
     "Serve Prometheus metrics (ft_* names) on this port (pip install "
     "'ft-launcher[metrics]') [off]."),
    ("--ft-metrics-addr", "metrics_addr",
     "Address the metrics port binds to [127.0.0.1]."),
    ("--ft-status-interval", "status_interval",
     "Seconds between the launcher's status lines: elapsed, cycle, restarts, last step, "
     "goodput (0 = off) [60]."),
    ("--ft-health-check", "health_checks",
     "A shell command run before every rendezvous; non-zero or past its timeout = this node "
     "does not join and exits for a requeue without it. Repeatable."),
    ("--ft-health-check-timeout", "health_check_timeout",
     "Seconds each health check may take, the built-in GPU query included [30]."),
    ("--ft-min-free-space", "min_free_space",
     "Free space the run directory needs to pass the health check: bytes or a size such as "
     "500MB (0 = no minimum) [100MB]."),
    ("--ft-snapshot-every", "snapshot_every",
     "How often to keep an in-memory snapshot of the state ranks pass to ft_agent's "
     "snapshot(): auto (the ranks agree on a frequency under --ft-snapshot-overhead), every "
     "N steps (5) or seconds (30s), or off; a restart resumes from the newest one every "
     "rank holds [auto]."),
    ("--ft-snapshot-overhead", "snapshot_overhead",
     "With --ft-snapshot-every auto: the share of the step time a snapshot may cost the "
     "training, e.g. 2% or 0.02 (the time snapshot() blocks, plus its background commit on "
     "a node with no idle core) [2%]."),
    ("--ft-snapshot-memory", "snapshot_memory",
     "Memory the snapshots may use on this node, shared by its ranks, e.g. 8GB; a "
     "snapshot over a rank's share is skipped [half of /dev/shm's free space]."),
    ("--ft-snapshot-replicas", "snapshot_replicas",
     "Copies of each rank's snapshot kept on other nodes (the next ones in the ring of "
     "group ranks), so a lost node's ranks can restore on a spare; 0: none [0]."),
]


FLAG_KEYS = {"skip_bad_iterations", "warm_restart", "agent_store",
             "learned_timeouts_override", "preload_learn"}
MULTIPLE_KEYS = {"health_checks"}
# NVRx's settings of the same name and meaning: their NVRx spellings are accepted too.
NVRX_KEYS = (*agent_config.BASE_PARSERS, "max_no_progress_cycles", "checkpoint_iteration_file")
ALIAS_PREFIX = "nvrx_alias__"
NOT_APPLICABLE_PREFIX = "nvrx_na__"


# NVRx flags whose name differs from their key.
NVRX_EXTRA_SPELLINGS = {
    "storage_healthcheck_path": ("--ft-storage-health-check-path",
                                 "--ft-storage_health_check_path",
                                 "--ft_storage_health_check_path"),
}


def _nvrx_spellings(key: str) -> list[str]:
    """NVRx 0.4-0.7 flag spellings of a setting: --ft-a-b, --ft-a_b, --ft_a_b,
    --ft-param-a_b (0.4), --ft-param-a-b and --ft_param_a_b."""
    dashed = key.replace("_", "-")
    names = [f"--ft-{dashed}", f"--ft-{key}", f"--ft_{key}", f"--ft-param-{key}",
             f"--ft-param-{dashed}", f"--ft_param_{key}", *NVRX_EXTRA_SPELLINGS.get(key, ())]
    return list(dict.fromkeys(names))


def _ft_option(flag: str, key: str, help_text: str):
    if key in FLAG_KEYS:
        return click.option(flag, key, is_flag=True, default=None, help=help_text)
    if key in MULTIPLE_KEYS:  # not given = None, so the YAML file's list still applies
        return click.option(flag, key, multiple=True, metavar="CMD", help=help_text,
                            callback=lambda _ctx, _param, value: list(value) or None)
    return click.option(flag, key, default=None, metavar="VALUE", help=help_text)


def _nvrx_options():
    """Hidden options: NVRx spellings of our settings, and NVRx flags that do not apply
    here (accepted with one warning each; docs/reference/options.md lists them)."""
    options = []
    for flag, key, _ in FT_OPTIONS:
        if key in NVRX_KEYS:
            aliases = [n for n in _nvrx_spellings(key) if n != flag]
            options.append(click.option(*aliases, ALIAS_PREFIX + key, default=None,
                                        hidden=True))
    for key in agent_config.NVRX_NOT_APPLICABLE:
        options.append(click.option(*_nvrx_spellings(key), NOT_APPLICABLE_PREFIX + key,
                                    default=None, hidden=True))
    for name in agent_config.NVRX_LAUNCHER_FLAGS_NOT_APPLICABLE:
        under = name.replace("-", "_")
        options.append(click.option(f"--ft-{name}", f"--ft-{under}", f"--ft_{under}",
                                    NOT_APPLICABLE_PREFIX + under, default=None, hidden=True))
    return options


def _with_ft_options(func):
    for flag, key, help_text in reversed(FT_OPTIONS):
        func = _ft_option(flag, key, help_text)(func)
    for option in _nvrx_options():
        func = option(func)
    return func


def ft_flags_given(opts: dict[str, Any]) -> tuple[dict[str, Any], list[NotApplicable]]:
    """The --ft-* settings given on the command line (NVRx spellings folded in) and the
    NVRx flags that do nothing here, checked."""
    given = {key: opts.get(key) for _, key, _ in FT_OPTIONS}
    not_applicable = []
    for name, value in opts.items():
        if value is None:
            continue
        if name.startswith(ALIAS_PREFIX):
            key = name[len(ALIAS_PREFIX):]
            if given.get(key) is not None:
                raise ConfigError(f"{_flag_of(key)} is given twice (once in NVRx spelling)")
            given[key] = value
        elif name.startswith(NOT_APPLICABLE_PREFIX):
            key = name[len(NOT_APPLICABLE_PREFIX):]
            if key not in agent_config.NVRX_NOT_APPLICABLE:
                key = _dashed(key)  # a launcher flag without a YAML key
            item = agent_config.check_not_applicable(key, value, f"--ft-{_dashed(key)}")
            if item is not None:
                not_applicable.append(item)
    return given, not_applicable


def _dashed(key: str) -> str:
    return key.replace("_", "-")


def _flag_of(key: str) -> str:
    return next(flag for flag, k, _ in FT_OPTIONS if k == key)


def build_ft_config(cfg_path: str | None, given: dict[str, Any],
                    not_applicable: list[NotApplicable] | None = None,
                    ignore_missing_cfg: bool = False) -> FaultToleranceConfig:
    """Defaults, then the YAML file, then options given on the command line. Settings
    given either way count as configured; NVRx settings that do nothing here get one
    warning each."""
    values: dict[str, Any] = {}
    ignored = list(not_applicable or [])
    if cfg_path and ignore_missing_cfg and not Path(cfg_path).exists():
        log.warning("--ft-cfg-path %s does not exist; --ft-ignore-missing-cfg: using the "
                    "options and defaults", cfg_path)
    elif cfg_path:
        values, from_file = load_yaml_settings(cfg_path)
        ignored = from_file + ignored
    for key, value in given.items():
        if value is not None:
            values[key] = parse_ft_value(key, value, _flag_of(key))
    assert set(values) <= set(FT_PARSERS)
    agent_config.warn_not_applicable(ignored)
    return FaultToleranceConfig.from_values(values)


class Seconds(click.ParamType):
    """A finite number of seconds in [low, high] (click's FloatRange lets NaN through)."""

    name = "seconds"

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            return agent_config.parse_number("value", value, self.low, self.high,
                                             low_inclusive=True)
        except ConfigError as exc:
            self.fail(str(exc).removeprefix("value: "), param, ctx)


CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.command(
    context_settings={**CONTEXT, "ignore_unknown_options": False,
                      "allow_interspersed_args": False},
    help="""Start NPROC_PER_NODE workers of TRAINING_SCRIPT on this node, restart the group
    when a worker fails or hangs, and exit with a code a scheduler can act on
    (0 done, 1 failed, 16 re-run elsewhere, 17 validation failed, 18 no progress).

    Options match torchrun's, and so do their PET_* variables: an option not given takes
    its value from PET_<OPTION> (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, ...; a flag
    from PET_<FLAG> as an integer, 0 = off). The --ft-* options add hang detection, fault
    injection and the rerun policy. Everything lands in the run directory (--ft-run-dir).
    NVRx's --ft-* flags and YAML keys are accepted too (docs/porting-from-nvrx.md).""",
)
@click.option("--nnodes", default="1", show_default=True, help="Nodes: N or MIN:MAX.")
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", default="1",
              show_default=True, help="Workers per node (an integer, or 'cpu').")
@click.option("--node-rank", "--node_rank", "node_rank", type=int, default=0, show_default=True,
              help="This node's rank (static rendezvous).")
@click.option("--master-addr", "--master_addr", "master_addr", default="127.0.0.1",
              show_default=True, help="Address of the rank-0 node (static rendezvous).")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None,
              help="Port for the workers' process group [a free port, new each cycle].")
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", default="static",
              type=click.Choice(["static", "c10d", "etcd", "torch-c10d", "etcd-v2"]),
              show_default=True,
              help="Rendezvous for several nodes: c10d (a store one launcher hosts), etcd "
                   "(v3: no single point of failure); torch-c10d and etcd-v2 are torch's.")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default="",
              help="host:port of the c10d store, or host:port[,host:port...] of etcd.")
@click.option("--rdzv-id", "--rdzv_id", "rdzv_id", default="none", show_default=True,
              help="Job id shared by every node; also the run id.")
@click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", default="",
              help="Extra rendezvous settings: key=value,...")
@click.option("--standalone", is_flag=True, help="Single node, local rendezvous.")
@click.option("--max-restarts", "--max_restarts", "max_restarts", type=click.IntRange(min=0),
              default=0, show_default=True, help="Restarts of the worker group before giving up.")
@click.option("--monitor-interval", "--monitor_interval", "monitor_interval",
              type=Seconds(0.001, 3600.0), default=0.1, show_default=True,
              help="Seconds between polls of other nodes (and of the warm-restart zygote "
                   "while its answer is due); worker exits, signals and messages are seen "
                   "at once.")
@click.option("--log-dir", "--log_dir", "log_dir", default=None,
              help="Directory for worker logs [RUN_DIR/logs].")
@click.option("-r", "--redirects", default=None,
              help="Keep worker output out of the console: 0-3 or local_rank:0-3,...")
@click.option("-t", "--tee", default=None,
              help="Also copy worker output to the console: 0-3 or local_rank:0-3,...")
@click.option("--local-ranks-filter", "--local_ranks_filter", "local_ranks_filter", default=None,
              help="Only these local ranks' output on the console, e.g. 0,1.")
@click.option("-m", "--module", is_flag=True, help="Run TRAINING_SCRIPT as 'python -m'.")
@click.option("--no-python", "--no_python", "no_python", is_flag=True,
              help="TRAINING_SCRIPT is an executable, not a Python file.")
@click.option("--run-path", "--run_path", "run_path", is_flag=True,
              help="Run the script by path (the default here; accepted for torchrun).")
@click.option("--term-timeout", "--term_timeout", "term_timeout", type=Seconds(0.0, 86400.0),
              default=30.0, show_default=True,
              help="Grace for workers after the launcher gets SIGTERM/SIGINT.")
@click.option("--workers-stop-timeout", "workers_stop_timeout", type=Seconds(0.0, 86400.0),
              default=15.0, show_default=True,
              help="Grace between SIGTERM and SIGKILL when stopping a group.")
@click.option("--workers-exit-timeout", "workers_exit_timeout", type=Seconds(0.0, 86400.0),
              default=30.0, show_default=True,
              help="Seconds a rank that said goodbye may take to exit once a peer exited "
                   "cleanly or a rank announced its exit 16/17; then its stack is dumped, it "
                   "is killed (exit_stuck) and the job succeeds, or goes on as the announced "
                   "code says. 0: wait for it forever.")
@click.option("--shutdown-timeout", "--shutdown_timeout", "shutdown_timeout",
              type=Seconds(0.0, 86400.0), default=None,
              help="torchrun's name for --term-timeout: seconds between the stop signal and "
                   "SIGKILL when the launcher is told to stop [TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "
                   "else 30].")
@click.option("--local-addr", "--local_addr", "local_addr", default=None,
              help="Address this node advertises in a dynamic rendezvous: its "
                   "workers' MASTER_ADDR when it holds group rank 0 [the address routed "
                   "towards the rendezvous endpoint].")
@click.option("--role", default="default", show_default=True,
              help="Role of this node's workers: ROLE_NAME in their environment.")
@click.option("--start-method", "--start_method", "start_method",
              type=click.Choice(torchrun_compat.START_METHODS), default=None,
              help="How workers start: spawn = a fresh interpreter each (a cold start); fork "
                   "or forkserver = forked from the node's zygote with the preloads imported "
                   "(warm restart) [as --ft-warm-restart says].")
@click.option("--virtual-local-rank", "--virtual_local_rank", "virtual_local_rank",
              is_flag=True,
              help="LOCAL_RANK=0 for every worker, and CUDA_VISIBLE_DEVICES names only the "
                   "device the rank is given, which becomes its device 0.")
@click.option("--signals-to-handle", "--signals_to_handle", "signals_to_handle", default=None,
              help="Signals the launcher catches for its workers, comma-separated: "
                   "SIGUSR1 and SIGUSR2 are handed to the workers and the job goes on; the "
                   "others stop the workers with that signal, as SIGTERM does "
                   "[SIGTERM,SIGINT,SIGHUP; SIGUSR1 handed on].")
@click.option("--numa-binding", "--numa_binding", "numa_binding",
              type=click.Choice(torchrun_compat.NUMA_MODES), default=None,
              help="Accepted for torchrun, not applied (one warning): workers keep the "
                   "launcher's CPU affinity; bind the launcher with numactl or taskset.")
@click.option("--logs-specs", "--logs_specs", "logs_specs", default=None,
              help="Accepted for torchrun, not applied (one warning): it names a torch "
                   "LogsSpecs plugin; worker logs go to RUN_DIR/logs or --log-dir.")
@click.option("--event-log-handler", "--event_log_handler", "event_log_handler", default=None,
              help="Accepted for torchrun, not applied (one warning unless 'null'): the "
                   "launcher's events go to RUN_DIR/events.jsonl.")
@click.option("--duplicate-stdout-filters", "--duplicate_stdout_filters",
              "duplicate_stdout_filters", default=None,
              help="Accepted for torchrun, not applied (one warning): every worker's output "
                   "is kept whole in RUN_DIR/logs; grep it there.")
@click.option("--duplicate-stderr-filters", "--duplicate_stderr_filters",
              "duplicate_stderr_filters", default=None,
              help="Accepted for torchrun, not applied (one warning): every worker's output "
                   "is kept whole in RUN_DIR/logs; grep it there.")
@click.option("--ft-run-dir", "run_dir", default=None,
              help="Run directory [./ft_runs/RUN_ID].")
@click.option("--ft-cfg-path", "--ft-cfg_path", "cfg_path", default=None,
              help="YAML file with a 'fault_tolerance:' section (NVRx key names).")
@click.option("--ft-ignore-missing-cfg", "ignore_missing_cfg", is_flag=True,
              help="Run with options and defaults when the --ft-cfg-path file is missing.")
@_with_ft_options
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.argument("training_script")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
def cli(**opts: Any) -> None:
    verbose = opts.pop("verbose")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="[ft_launcher %(asctime)s] %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_context(click.get_current_context(), opts, os.environ)
        if not verbose:  # NVRx's log_level; -v still means debug
            logging.getLogger().setLevel(cfg.ft.log_level)
        from ft_launcher.process.workers import raise_fd_limit
        from ft_launcher.supervisor import Supervisor  # after validation: imports zmq

        raise_fd_limit()  # each rank's connection costs a descriptor; workers keep the old limit
        supervisor = Supervisor(cfg)
    except (ConfigError, OSError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(supervisor.run())


def launch_config_from_args(args: list[str],
                            environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parse a command line as ``ft_launcher`` does, PET_* variables included, and build its
    LaunchConfig without starting anything (click's usage errors and ConfigError raise)."""
    ctx = cli.make_context("ft_launcher", list(args))
    with ctx:
        opts = dict(ctx.params)
        opts.pop("verbose", None)
        return config_from_context(ctx, opts, os.environ if environ is None else environ)


def config_from_context(ctx: click.Context, opts: dict[str, Any],
                        environ: Mapping[str, str]) -> LaunchConfig:
    """Options given on the command line, then torchrun's PET_* variables for the others
    (as torchrun reads them), then the defaults."""
    origin = _given_on_command_line(ctx, opts)
    opts = dict(opts)
    for pet in torchrun_compat.pet_defaults(environ, set(origin)):
        opts[pet.name] = _pet_value(ctx, pet)
        origin[pet.name] = pet.var
    return build_launch_config(opts, origin, environ)


def _given_on_command_line(ctx: click.Context, opts: dict[str, Any]) -> dict[str, str]:
    """Option name -> the spelling that names it in errors, for those given as flags."""
    out = {}
    for param in ctx.command.params:
        if param.name in opts and \
                ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
            longs = [o for o in param.opts if o.startswith("--")]
            out[param.name] = (longs or param.opts)[0]
    return out


def _pet_value(ctx: click.Context, pet: torchrun_compat.PetValue) -> Any:
    """A PET_ variable's value, converted as its option's would be; errors name it."""
    if pet.name in torchrun_compat.PET_FLAG_OPTIONS:
        return torchrun_compat.parse_pet_flag(pet.var, pet.raw)
    param = next(p for p in ctx.command.params if p.name == pet.name)
    try:
        return param.type_cast_value(ctx, pet.raw)
    except click.BadParameter as exc:
        raise ConfigError(f"{pet.var}: {exc.message}") from None


def build_launch_config(opts: dict[str, Any], origin: Mapping[str, str] | None = None,
                        environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Turn parsed options into a LaunchConfig; raises ConfigError for user mistakes.

    ``origin`` names where each value not defaulted came from (a flag or a PET_ variable),
    for the errors; ``environ`` is the launcher's environment (TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
    """
    src = _Sources(origin or {})
    environ = os.environ if environ is None else environ
    for message in torchrun_compat.not_applied(opts):
        log.warning("%s", message)
    given, not_applicable = ft_flags_given(opts)
    ft = build_ft_config(opts["cfg_path"], given, not_applicable,
                         bool(opts.get("ignore_missing_cfg")))
    ft = _apply_start_method(ft, opts.get("start_method"), src("start_method", "--start-method"))
    nproc = _nproc(str(opts["nproc_per_node"]), src("nproc_per_node", "--nproc-per-node"))
    min_nodes, max_nodes, backend = _nodes(opts, src)
    run_id = opts["rdzv_id"] if opts["rdzv_id"] != "none" else _default_run_id()
    return LaunchConfig(
        entrypoint=_entrypoint(opts["training_script"], opts["module"], opts["no_python"]),
        script_args=list(opts["training_script_args"]),
        nproc_per_node=nproc, min_nodes=min_nodes, max_nodes=max_nodes,
        node_rank=opts["node_rank"], master_addr=opts["master_addr"],
        master_port=opts["master_port"], rdzv_backend=backend,
        rdzv_endpoint=opts["rdzv_endpoint"], rdzv_id=run_id,
        rdzv_conf=_parse_kv(src("rdzv_conf", "--rdzv-conf"), opts["rdzv_conf"]),
        max_restarts=opts["max_restarts"], monitor_interval=opts["monitor_interval"],
        run_id=run_id,
        run_dir=Path(opts["run_dir"]) if opts["run_dir"] else Path("ft_runs") / run_id,
        log_dir=Path(opts["log_dir"]) if opts["log_dir"] else None,
        redirects=_parse_per_rank(src("redirects", "--redirects"), opts["redirects"], nproc),
        tee=_parse_per_rank(src("tee", "--tee"), opts["tee"], nproc),
        local_ranks_filter=_ranks_filter(opts.get("local_ranks_filter"),
                                         src("local_ranks_filter", "--local-ranks-filter")),
        term_timeout=_term_timeout(opts, src, environ),
        workers_stop_timeout=opts["workers_stop_timeout"],
        workers_exit_timeout=opts["workers_exit_timeout"],
        ft=ft,
        **_torchrun_extras(opts, src),
    )


class _Sources:
    """The name of an option in errors: the flag given, or the PET_ variable read."""

    def __init__(self, origin: Mapping[str, str]) -> None:
        self.origin = origin

    def __call__(self, key: str, flag: str) -> str:
        return self.origin.get(key, flag)

    def from_flag(self, key: str) -> bool:
        """Given on the command line (not defaulted, not from a PET_ variable)."""
        return key in self.origin and not self.origin[key].startswith("PET_")


def _nproc(text: str, source: str) -> int:
    """torchrun's --nproc-per-node: an integer, cpu, gpu or auto (GPUs, else CPUs)."""
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        from ft_launcher.nodes.health import count_gpus

        if gpus := count_gpus():
            return gpus
        if text == "auto":
            return os.cpu_count() or 1
        raise ConfigError(f"{source} gpu: no GPU is visible on this node")
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(f"{source}: expected a positive integer, cpu, gpu or auto, got {text!r}")


def _nodes(opts: dict[str, Any], src: _Sources) -> tuple[int, int, str]:
    """(min nodes, max nodes, rendezvous backend), checked against the node options."""
    min_nodes, max_nodes = _parse_nnodes(opts["nnodes"], src("nnodes", "--nnodes"))
    backend = opts["rdzv_backend"]
    if opts["standalone"]:
        if max_nodes > 1:
            raise ConfigError("--standalone runs one node; --nnodes must be 1")
        backend = "static"
    if backend == "static" and max_nodes > 1 and min_nodes != max_nodes:
        raise ConfigError(f"{src('nnodes', '--nnodes')} MIN:MAX needs --rdzv-backend c10d "
                          f"or etcd")
    node_rank, port = opts["node_rank"], opts["master_port"]
    if not 0 <= node_rank < max_nodes:
        raise ConfigError(f"{src('node_rank', '--node-rank')} {node_rank}: must be in "
                          f"0..{max_nodes - 1}")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"{src('master_port', '--master-port')} {port}: not a port number")
    if backend == "static" and max_nodes > 1 and port is None:
        raise ConfigError("--master-port: required for several nodes with the static backend")
    return min_nodes, max_nodes, backend


def _ranks_filter(text: str | None, source: str) -> set[int] | None:
    if not text:
        return None
    try:
        return {int(r) for r in text.split(",")}
    except ValueError:
        raise ConfigError(f"{source}: expected e.g. 0,1, got {text!r}") from None


def _apply_start_method(ft: FaultToleranceConfig, method: str | None,
                        source: str) -> FaultToleranceConfig:
    """torchrun's --start-method: spawn = cold start, fork/forkserver = warm restart."""
    if method is None:
        return ft
    warm = torchrun_compat.warm_from_start_method(method)
    if "warm_restart" in ft.configured and ft.warm_restart != warm:
        raise ConfigError(f"{source} {method}: contradicts the warm restart setting "
                          f"(spawn = cold start; fork, forkserver = warm restart)")
    return dataclasses.replace(ft, warm_restart=warm)


def _term_timeout(opts: dict[str, Any], src: _Sources, environ: Mapping[str, str]) -> float:
    """--term-timeout, or torchrun's --shutdown-timeout (the same grace), or its
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, or the default."""
    term, shutdown = opts["term_timeout"], opts.get("shutdown_timeout")
    if src.from_flag("term_timeout"):
        if src.from_flag("shutdown_timeout") and shutdown != term:
            raise ConfigError(f"--shutdown-timeout {shutdown:g} and --term-timeout {term:g}: "
                              f"the same grace, given twice")
        return term
    if shutdown is not None:
        return shutdown
    from_env = torchrun_compat.shutdown_timeout_from_env(environ)
    return term if from_env is None else from_env


def _torchrun_extras(opts: dict[str, Any], src: _Sources) -> dict[str, Any]:
    """The LaunchConfig fields of torchrun's --role, --local-addr, --signals-to-handle,
    --virtual-local-rank and --start-method."""
    role = "default" if opts.get("role") is None else opts["role"]
    if "\0" in role:
        raise ConfigError(f"{src('role', '--role')}: a role name cannot hold NUL")
    addr = opts.get("local_addr")
    if addr is not None and (not addr or len(addr) > 255 or any(c.isspace() for c in addr)):
        raise ConfigError(f"{src('local_addr', '--local-addr')}: expected a host name or IP "
                          f"address, got {addr!r}")
    signals = opts.get("signals_to_handle")
    return {
        "role": role,
        "local_addr": addr,
        "signals_to_handle": None if signals is None else tuple(
            int(s) for s in torchrun_compat.parse_signals(
                src("signals_to_handle", "--signals-to-handle"), signals)),
        "virtual_local_rank": bool(opts.get("virtual_local_rank")),
        "start_method": opts.get("start_method"),
    }


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
