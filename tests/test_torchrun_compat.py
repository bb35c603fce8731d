"""torchrun's command line, read from torch's own parser at test time: every option and its
underscore spelling is accepted and parses with a representative value; PET_* variables
are read as torchrun reads them (a flag beats its variable); the meaning given to each
option; one real launcher started from PET_* variables alone."""

from __future__ import annotations

import argparse
import json
import logging
import signal

import click
import pytest
import torch
from launch_helpers import NO_PRELOADS, SCRIPTS, run_launcher
from torch_support import TORCH, readme_torch, version_tuple

from ft_launcher import torchrun_compat
from ft_launcher.cli import launch_config_from_args
from ft_launcher.config import ConfigError

torch_run = pytest.importorskip("torch.distributed.run")

# A value each torchrun option parses with here (a new torchrun option without one is given
# its first choice, or a value of its type).
REPRESENTATIVE = {
    "nnodes": "1", "nproc_per_node": "2", "rdzv_backend": "static",
    "rdzv_endpoint": "127.0.0.1:29400", "rdzv_id": "job-7", "rdzv_conf": "join_timeout=60",
    "max_restarts": "3", "monitor_interval": "0.5", "start_method": "spawn",
    "event_log_handler": "console", "role": "trainer", "log_dir": "LOGDIR",
    "redirects": "3", "tee": "0:1,1:2", "local_ranks_filter": "0,1",
    "duplicate_stdout_filters": "loss,,step,lr", "duplicate_stderr_filters": "error",
    "node_rank": "0", "master_addr": "127.0.0.1", "master_port": "29511",
    "local_addr": "127.0.0.1", "logs_specs": "default", "numa_binding": "node",
    "signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "shutdown_timeout": "12",
}
FLAG_SCRIPTS = {"module": "json.tool", "no_python": "true"}  # what the flag launches
# Options of a torchrun newer than the README's torch that ft_launcher does not accept yet, by
# the torch that added them: the tests below leave them out and
# test_torchrun_options_not_accepted_yet names them in its skip.
NOT_ACCEPTED_YET = {"log_line_prefix_template": "2.14", "print_completion": "2.14"}


def _all_torch_options() -> list[argparse.Action]:
    parser = torch_run.get_args_parser()
    return [a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _torch_options() -> list[argparse.Action]:
    return [a for a in _all_torch_options() if a.dest not in NOT_ACCEPTED_YET]


def _readme_torch() -> str:
    return ".".join(map(str, readme_torch()))


def _is_flag(action: argparse.Action) -> bool:
    return action.nargs == 0


def _value(action: argparse.Action, tmp_path) -> str:
    if action.dest in REPRESENTATIVE:
        value = REPRESENTATIVE[action.dest]
        return str(tmp_path / "logs") if value == "LOGDIR" else value
    if action.choices:
        return str(list(action.choices)[0])
    return {int: "1", float: "1.0"}.get(action.type, "x")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture(autouse=True)
def _no_pet(monkeypatch):
    """The machine's own PET_* variables (if any) stay out of these tests."""
    import os

    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv(torchrun_compat.ENV_SHUTDOWN_TIMEOUT, raising=False)


def _parse(args: list[str], script: str, environ: dict[str, str] | None = None):
    return launch_config_from_args([*args, script], environ or {})


def test_every_torchrun_option_and_spelling_is_accepted_with_a_value(tmp_path, script):
    refused = []
    for action in _torch_options():
        for spelling in action.option_strings:
            args = [spelling] if _is_flag(action) else [spelling, _value(action, tmp_path)]
            target = FLAG_SCRIPTS.get(action.dest, script)
            try:
                launch_config_from_args([*args, target], {})
            except (click.UsageError, ConfigError) as exc:
                refused.append(f"{' '.join(args)}: {exc}")
    assert not refused, "torchrun options ft_launcher refuses:\n" + "\n".join(refused)


def test_every_choice_torchrun_offers_is_accepted(script):
    for action in _torch_options():
        for choice in action.choices or ():
            launch_config_from_args([action.option_strings[0], str(choice), script], {})


def test_torchrun_options_not_accepted_yet():
    assert all(version_tuple(v) > readme_torch() for v in NOT_ACCEPTED_YET.values()), \
        "the README's torch has them: accept them"
    newer = [a.option_strings[0] for a in _all_torch_options() if a.dest in NOT_ACCEPTED_YET]
    if newer:
        pytest.skip(f"torch {torch.__version__}'s torchrun has {', '.join(newer)}, which "
                    f"ft_launcher does not accept yet (it follows torchrun {_readme_torch()})")


def test_pet_variables_are_those_torchrun_reads():
    """torch's env action reads PET_<DEST>; its check_env action reads flags. An older
    torchrun than the README's reads fewer: each of those is read here too."""
    actions = _torch_options()
    values = {a.dest for a in actions if type(a).__name__ == "env"}
    flags = {a.dest for a in actions if type(a).__name__ == "check_env"}
    assert values <= set(torchrun_compat.PET_VALUE_OPTIONS)
    assert flags <= set(torchrun_compat.PET_FLAG_OPTIONS)
    if TORCH < readme_torch():
        newer = sorted({*torchrun_compat.PET_VALUE_OPTIONS, *torchrun_compat.PET_FLAG_OPTIONS}
                       - values - flags)
        pytest.skip(f"torch {torch.__version__}'s torchrun has no {', '.join(newer)}: "
                    f"read here as torchrun {_readme_torch()} reads them")
    assert values == set(torchrun_compat.PET_VALUE_OPTIONS)
    assert flags == set(torchrun_compat.PET_FLAG_OPTIONS)


def test_each_pet_variable_means_what_its_flag_means(tmp_path, script):
    base = ["--ft-run-dir", str(tmp_path / "run")]
    for action in _torch_options():
        if action.dest not in (*torchrun_compat.PET_VALUE_OPTIONS,
                               *torchrun_compat.PET_FLAG_OPTIONS):
            continue
        fixed = [] if action.dest == "rdzv_id" else ["--rdzv-id", "fixed"]
        target = FLAG_SCRIPTS.get(action.dest, script)
        raw = "1" if _is_flag(action) else _value(action, tmp_path)
        flag = [action.option_strings[-1]] + ([] if _is_flag(action) else [raw])
        by_flag = launch_config_from_args([*base, *fixed, *flag, target], {})
        by_pet = launch_config_from_args([*base, *fixed, target],
                                         {torchrun_compat.pet_var(action.dest): raw})
        assert by_pet == by_flag, action.dest


@pytest.mark.parametrize("env", [
    {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.1.2.3",
     "PET_MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "4", "PET_MAX_RESTARTS": "5",
     "PET_ROLE": "learner", "PET_STANDALONE": "0"},
    {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "3", "PET_STANDALONE": "7",
     "PET_RDZV_ID": "abc", "PET_MONITOR_INTERVAL": "0.25"},
])
def test_pet_values_read_the_same_as_torchruns_own_parser(monkeypatch, script, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    theirs = torch_run.get_args_parser().parse_args([script])  # reads os.environ now
    ours = _parse([], script, env)
    lo, _, hi = theirs.nnodes.partition(":")
    assert (ours.min_nodes, ours.max_nodes) == (int(lo), int(hi or lo))
    assert ours.nproc_per_node == int(theirs.nproc_per_node)
    assert ours.node_rank == theirs.node_rank and ours.max_restarts == theirs.max_restarts
    assert ours.role == theirs.role and ours.monitor_interval == theirs.monitor_interval
    assert ours.master_addr == theirs.master_addr
    if "PET_MASTER_PORT" not in env and TORCH < readme_torch() and theirs.master_port == 29500:
        # an older torchrun's default; the README's has none (a free port), as ft_launcher
        assert ours.master_port is None
    else:
        assert ours.master_port == theirs.master_port
    assert (ours.rdzv_id == theirs.rdzv_id) or theirs.rdzv_id == "none"
    assert bool(theirs.standalone) == (env.get("PET_STANDALONE", "0") != "0")


def test_a_flag_beats_its_variable(script):
    env = {"PET_NPROC_PER_NODE": "2", "PET_STANDALONE": "0", "PET_ROLE": "a"}
    cfg = _parse(["--nproc_per_node", "3", "--role", "b"], script, env)
    assert (cfg.nproc_per_node, cfg.role) == (3, "b")
    assert _parse([], script, env).nproc_per_node == 2
    # PET_STANDALONE=0 does not turn a given --standalone off (torchrun's check_env)
    with pytest.raises(ConfigError, match="--standalone"):
        _parse(["--standalone", "--nnodes", "2"], script, env)


@pytest.mark.parametrize("env, needle", [
    ({"PET_MASTER_PORT": "abc"}, "PET_MASTER_PORT"),
    ({"PET_MASTER_PORT": "70000"}, "PET_MASTER_PORT"),
    ({"PET_NPROC_PER_NODE": "zero"}, "PET_NPROC_PER_NODE"),
    ({"PET_NPROC_PER_NODE": ""}, "PET_NPROC_PER_NODE"),
    ({"PET_NNODES": "1:x"}, "PET_NNODES"),
    ({"PET_NODE_RANK": "3"}, "PET_NODE_RANK"),
    ({"PET_MAX_RESTARTS": "-1"}, "PET_MAX_RESTARTS"),
    ({"PET_MONITOR_INTERVAL": "nan"}, "PET_MONITOR_INTERVAL"),
    ({"PET_RDZV_BACKEND": "zookeeper"}, "PET_RDZV_BACKEND"),
    ({"PET_START_METHOD": "thread"}, "PET_START_METHOD"),
    ({"PET_STANDALONE": "true"}, "PET_STANDALONE"),
    ({"PET_VIRTUAL_LOCAL_RANK": "yes"}, "PET_VIRTUAL_LOCAL_RANK"),
    ({"PET_SIGNALS_TO_HANDLE": "SIGNOPE"}, "PET_SIGNALS_TO_HANDLE"),
    ({"PET_SHUTDOWN_TIMEOUT": "soon"}, "PET_SHUTDOWN_TIMEOUT"),
    ({"PET_REDIRECTS": "9"}, "PET_REDIRECTS"),
    ({"PET_RDZV_CONF": "novalue"}, "PET_RDZV_CONF"),
    ({"PET_LOCAL_RANKS_FILTER": "a"}, "PET_LOCAL_RANKS_FILTER"),
    ({"PET_LOCAL_ADDR": "two words"}, "PET_LOCAL_ADDR"),
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-3"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
])
def test_a_bad_variable_is_named_in_the_error(script, env, needle):
    with pytest.raises(ConfigError, match=needle):
        _parse([], script, env)


def test_role_local_addr_and_virtual_local_rank_are_carried(script):
    cfg = _parse(["--role", "critic", "--local-addr", "node-7.cluster", "--virtual_local_rank"],
                 script)
    assert (cfg.role, cfg.local_addr, cfg.virtual_local_rank) == \
        ("critic", "node-7.cluster", True)
    cfg = _parse([], script)
    assert (cfg.role, cfg.local_addr, cfg.virtual_local_rank) == ("default", None, False)


def test_start_method_spawn_is_a_cold_start_and_fork_a_warm_one(script):
    assert _parse([], script).ft.warm_restart is True  # the default: warm
    assert _parse(["--start-method", "spawn"], script).ft.warm_restart is False
    assert _parse(["--start_method", "fork"], script).ft.warm_restart is True
    assert _parse(["--start-method", "forkserver"], script).ft.warm_restart is True
    assert _parse(["--start-method", "fork", "--ft-warm-restart"], script).ft.warm_restart
    with pytest.raises(ConfigError, match="--start-method spawn"):
        _parse(["--start-method", "spawn", "--ft-warm-restart"], script)
    with pytest.raises(ConfigError, match="PET_START_METHOD fork"):
        _parse(["--no-ft-warm-restart"], script, {"PET_START_METHOD": "fork"})
    assert _parse([], script, {"PET_START_METHOD": "spawn"}).ft.warm_restart is False


def test_shutdown_timeout_is_the_term_timeout(script):
    assert _parse([], script).term_timeout == 30.0
    assert _parse(["--shutdown-timeout", "7"], script).term_timeout == 7.0
    assert _parse([], script, {"PET_SHUTDOWN_TIMEOUT": "8"}).term_timeout == 8.0
    assert _parse([], script, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "9"}).term_timeout == 9.0
    both = {"PET_SHUTDOWN_TIMEOUT": "8", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "9"}
    assert _parse([], script, both).term_timeout == 8.0
    assert _parse(["--term-timeout", "5"], script, both).term_timeout == 5.0
    assert _parse(["--term-timeout", "5", "--shutdown_timeout", "5"], script).term_timeout == 5
    with pytest.raises(ConfigError, match="given twice"):
        _parse(["--term-timeout", "5", "--shutdown-timeout", "6"], script)


def test_signals_to_handle_parse_to_signal_numbers(script):
    cfg = _parse(["--signals-to-handle", "SIGTERM, sigusr1,HUP,SIGTERM"], script)
    assert cfg.signals_to_handle == (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
    assert _parse([], script).signals_to_handle is None
    for bad in ("SIGKILL", "SIGCHLD", "", "SIG_DFL", "9"):
        with pytest.raises(ConfigError, match="--signals-to-handle"):
            _parse(["--signals-to-handle", bad], script)


def test_handled_signals_split_into_those_that_stop_and_those_handed_on(script):
    split = torchrun_compat.split_signals
    assert split(None) == ((signal.SIGTERM, signal.SIGINT, signal.SIGHUP), (signal.SIGUSR1,))
    cfg = _parse(["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"],
                 script)
    assert split(cfg.signals_to_handle) == (
        (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT),
        (signal.SIGUSR1, signal.SIGUSR2))


def test_duplicate_filters_split_as_torchrun_splits_them():
    assert torchrun_compat.parse_filters("a,,b,c") == ["a,b", "c"]
    assert torchrun_compat.parse_filters("") == []


@pytest.mark.parametrize("args, env, needle", [
    (["--logs-specs", "mine"], {}, "--logs-specs"),
    (["--event-log-handler", "console"], {}, "--event-log-handler"),
    ([], {"PET_EVENT_LOG_HANDLER": "console"}, "--event-log-handler"),
    (["--numa-binding", "socket"], {}, "--numa-binding"),
    (["--duplicate-stdout-filters", "loss"], {}, "--duplicate-stdout-filters"),
    ([], {"PET_DUPLICATE_STDERR_FILTERS": "err"}, "--duplicate-stderr-filters"),
])
def test_an_option_that_cannot_apply_warns_once_saying_what_is_done(caplog, script, args,
                                                                     env, needle):
    with caplog.at_level(logging.WARNING, logger="ft_launcher"):
        _parse(args, script, env)
    said = [r.getMessage() for r in caplog.records if needle in r.getMessage()]
    assert len(said) == 1 and ("RUN_DIR" in said[0] or "affinity" in said[0]), said


def test_torchruns_defaults_for_the_torch_only_options_warn_nothing(caplog, script):
    with caplog.at_level(logging.WARNING, logger="ft_launcher"):
        _parse(["--event-log-handler", "null", "--duplicate-stdout-filters", ""], script)
    assert not caplog.records


def test_nproc_per_node_auto_is_the_cpu_count_without_gpus(monkeypatch, script):
    import os

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever the machine
    assert _parse(["--nproc-per-node", "auto"], script).nproc_per_node == (os.cpu_count() or 1)
    with pytest.raises(ConfigError, match="--nproc-per-node gpu"):
        _parse(["--nproc-per-node", "gpu"], script)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert _parse(["--nproc-per-node", "gpu"], script).nproc_per_node == 2


# -- a real launcher ------------------------------------------------------------------------

def _world_sizes(run_dir) -> dict[int, str]:
    seen = {}
    for path in sorted((run_dir / "env").glob("cycle_0_rank_*.json")):
        env = json.loads(path.read_text())["env"]
        seen[int(env["RANK"])] = env["WORLD_SIZE"]
    return seen


def test_a_launcher_started_with_pet_variables_only_runs_their_world(tmp_path):
    run_dir = tmp_path / "run"
    res = run_launcher(run_dir, *NO_PRELOADS, str(SCRIPTS / "env_dump.py"),
                       env={"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2"})
    assert res.returncode == 0, res.stdout[-3000:]
    assert _world_sizes(run_dir) == {0: "2", 1: "2"}


def test_a_flag_overrides_a_pet_variable_in_a_real_launch(tmp_path):
    run_dir = tmp_path / "run"
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "1",
                       str(SCRIPTS / "env_dump.py"),
                       env={"PET_NPROC_PER_NODE": "2", "PET_ROLE": "critic"})
    assert res.returncode == 0, res.stdout[-3000:]
    assert _world_sizes(run_dir) == {0: "1"}
    env = json.loads((run_dir / "env" / "cycle_0_rank_0.json").read_text())["env"]
    assert env["ROLE_NAME"] == "critic"


def test_a_bad_pet_variable_stops_the_launcher_naming_it(tmp_path):
    res = run_launcher(tmp_path / "run", str(SCRIPTS / "env_dump.py"),
                       env={"PET_NPROC_PER_NODE": "two"}, timeout=60)
    assert res.returncode != 0 and "PET_NPROC_PER_NODE" in res.stdout, res.stdout[-2000:]


def test_the_help_lists_every_torchrun_option():
    from click.testing import CliRunner

    from ft_launcher.cli import cli

    out = CliRunner().invoke(cli, ["--help"]).output
    missing = [a.option_strings for a in _torch_options()
               if not any(s in out for s in a.option_strings)]
    assert not missing


def test_a_torchrun_command_line_runs_as_it_is(tmp_path):
    """A job script's torchrun options, as written for torchrun, start a real job."""
    run_dir = tmp_path / "run"
    res = run_launcher(run_dir, "--nnodes=1:1", "--nproc_per_node=2", "--start-method", "spawn",
                       "--role", "trainer", "--shutdown-timeout", "5", "--local_addr",
                       "127.0.0.1", "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                       "--logs-specs", "mine", "--event_log_handler", "null",
                       str(SCRIPTS / "env_dump.py"))
    assert res.returncode == 0, res.stdout[-3000:]
    assert _world_sizes(run_dir) == {0: "2", 1: "2"}
    env = json.loads((run_dir / "env" / "cycle_0_rank_1.json").read_text())["env"]
    assert env["ROLE_NAME"] == "trainer"
    assert res.stdout.count("--logs-specs names a torchrun.logs_specs plugin") == 1
    assert "--event-log-handler" not in res.stdout  # 'null' asks for nothing
