"""Configuration checks: every number finite and in range, the learned-timeout options, the
default initial timeout, unreadable YAML files, and NVRx's keys and flags (fast, no workers)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import ft_agent
from ft_agent import config as agent_config
from ft_launcher.cli import FT_OPTIONS, build_ft_config, cli, ft_flags_given
from ft_launcher.config import (
    DEFAULT_INITIAL_TIMEOUT_S,
    ConfigError,
    FaultToleranceConfig,
    load_yaml_section,
)

NUMERIC_FLAGS = {
    "initial_rank_heartbeat_timeout": "--ft-initial-rank-heartbeat-timeout",
    "rank_heartbeat_timeout": "--ft-rank-heartbeat-timeout",
    "rank_out_of_section_timeout": "--ft-rank-out-of-section-timeout",
    "safety_factor": "--ft-safety-factor",
    "min_learned_timeout": "--ft-min-learned-timeout",
}


def yaml_file(tmp_path, text: str | bytes, name: str = "ft.yaml") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


# -- item 2: finite and in range -------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(NUMERIC_FLAGS))
@pytest.mark.parametrize("bad", ["nan", "NaN", "inf", "-inf", "1e999", "-1", "0", "soon", "1e9"])
def test_every_numeric_flag_is_finite_and_in_range(key, bad):
    with pytest.raises(ConfigError) as err:
        build_ft_config(None, {key: bad})
    assert str(err.value).startswith(NUMERIC_FLAGS[key] + ": ")


@pytest.mark.parametrize("key", sorted(NUMERIC_FLAGS))
@pytest.mark.parametrize("bad", [".nan", ".inf", "-.inf", "-1", "0", "true", "[1]"])
def test_every_numeric_yaml_key_is_finite_and_in_range(tmp_path, key, bad):
    path = yaml_file(tmp_path, f"fault_tolerance:\n  {key}: {bad}\n")
    with pytest.raises(ConfigError) as err:
        build_ft_config(path, {})
    assert str(err.value).startswith(f"{path}: fault_tolerance.{key}: ")


@pytest.mark.parametrize("text", ["step:nan", "step:inf", "step:-1", "step:0", "step"])
def test_section_timeouts_are_checked_per_section(text):
    with pytest.raises(ConfigError, match=r"--ft-rank-section-timeouts"):
        build_ft_config(None, {"rank_section_timeouts": text})


@pytest.mark.parametrize(("value", "error"), [
    ({f"s{i}": 1 for i in range(300)}, "300 sections, more than 256"),
    ({"x" * 200: 1}, "is not 1 to 128 printable"),
    ({"a\x1bb": 1}, "is not 1 to 128 printable"),
    ({5: 1}, "is not 1 to 128 printable"),
])
def test_section_timeouts_are_bounded(value, error):
    with pytest.raises(ConfigError, match=error):
        agent_config.parse_section_timeouts("rank_section_timeouts", value)


def test_section_timeouts_in_yaml_name_the_section(tmp_path):
    path = yaml_file(tmp_path, "fault_tolerance:\n  rank_section_timeouts: {step: .nan}\n")
    with pytest.raises(ConfigError, match=r"rank_section_timeouts\[step\]: must be a finite"):
        build_ft_config(path, {})


def test_safety_factor_below_one_is_refused_and_good_values_pass():
    with pytest.raises(ConfigError, match="--ft-safety-factor: must be at least 1"):
        build_ft_config(None, {"safety_factor": "0.5"})
    ft = build_ft_config(None, {"safety_factor": "2", "rank_heartbeat_timeout": "1e3",
                                "min_learned_timeout": "0.5"})
    assert (ft.safety_factor, ft.rank_heartbeat_timeout, ft.min_learned_timeout) == \
        (2.0, 1000.0, 0.5)


@pytest.mark.parametrize(("key", "bad"), [("max_no_progress_cycles", "-2"),
                                          ("max_no_progress_cycles", "1.5"),
                                          ("rank_termination_signal", "SIGNOPE"),
                                          ("log_level", "LOUD")])
def test_other_values_are_checked(key, bad):
    with pytest.raises(ConfigError):
        build_ft_config(None, {key: bad})


# -- item 3: learned-timeout options and what the user configured ---------------------------


def test_learned_timeout_options_defaults_flags_and_yaml(tmp_path):
    ft = build_ft_config(None, {})
    assert ft.min_learned_timeout == 60.0 and ft.learned_timeouts_override is False
    assert ft.configured == frozenset()
    ft = build_ft_config(None, {"min_learned_timeout": "5", "learned_timeouts_override": True})
    assert ft.min_learned_timeout == 5.0 and ft.learned_timeouts_override is True
    path = yaml_file(tmp_path, "fault_tolerance:\n  min_learned_timeout: 7\n"
                               "  learned_timeouts_override: true\n")
    ft = build_ft_config(path, {})
    assert ft.min_learned_timeout == 7.0 and ft.learned_timeouts_override is True


def test_configured_names_what_the_user_gave_by_flag_or_file(tmp_path):
    path = yaml_file(tmp_path, "fault_tolerance:\n  rank_heartbeat_timeout: 30\n"
                               "  initial_rank_heartbeat_timeout: null\n")
    ft = build_ft_config(path, {"safety_factor": "3", "rank_out_of_section_timeout": None})
    assert ft.configured == {"rank_heartbeat_timeout", "initial_rank_heartbeat_timeout",
                             "safety_factor"}
    # A default (here: the initial timeout's, when another is set) is not "configured".
    ft = build_ft_config(None, {"rank_heartbeat_timeout": "5"})
    assert "initial_rank_heartbeat_timeout" not in ft.configured


def test_learned_timeouts_override_is_a_flag_in_help():
    res = subprocess.run([sys.executable, "-m", "ft_launcher.cli", "--help"],
                         capture_output=True, text=True, timeout=60)
    text = " ".join(res.stdout.split())
    assert "--ft-min-learned-timeout" in text and "--ft-learned-timeouts-override" in text
    assert f"Defaults to {DEFAULT_INITIAL_TIMEOUT_S:.0f} when any heartbeat or section " \
           "timeout is set" in text


# -- item 4: a finite initial timeout once any timeout is set -------------------------------


@pytest.mark.parametrize("given", [{"rank_heartbeat_timeout": "5"},
                                   {"rank_section_timeouts": "step:30"},
                                   {"rank_out_of_section_timeout": "30"}])
def test_initial_timeout_defaults_when_another_timeout_is_set(given):
    assert build_ft_config(None, given).initial_rank_heartbeat_timeout == \
        DEFAULT_INITIAL_TIMEOUT_S == 600.0


@pytest.mark.parametrize(("given", "expected"), [
    ({}, None),  # nothing set: learned, as before
    ({"rank_section_timeouts": "step:none"}, None),  # a section without a timeout
    ({"rank_heartbeat_timeout": "5", "initial_rank_heartbeat_timeout": "none"}, None),
    ({"rank_heartbeat_timeout": "5", "initial_rank_heartbeat_timeout": "40"}, 40.0),
])
def test_initial_timeout_default_does_not_override_the_user(given, expected):
    assert build_ft_config(None, given).initial_rank_heartbeat_timeout == expected


def test_explicit_null_in_yaml_keeps_the_initial_timeout_off(tmp_path):
    path = yaml_file(tmp_path, "fault_tolerance:\n  initial_rank_heartbeat_timeout: null\n"
                               "  rank_heartbeat_timeout: 10\n")
    assert build_ft_config(path, {}).initial_rank_heartbeat_timeout is None
    path = yaml_file(tmp_path, "fault_tolerance:\n  rank_heartbeat_timeout: 10\n", "b.yaml")
    assert build_ft_config(path, {}).initial_rank_heartbeat_timeout == 600.0


# -- item 15: unreadable files are one clear error naming the file --------------------------


@pytest.mark.parametrize(("content", "error"), [
    (b"fault_tolerance:\n  rank_heartbeat_timeout: 5 \xff\xfe\n", "not UTF-8 text"),
    (b"\xff\xfe\x00f\x00a", "not UTF-8 text"),
    (b"fault_tolerance: [1, 2]\n", "must be a mapping"),
    (b"- 1\n- 2\n", "expected a mapping"),
    (b"'just text'\n", "expected a mapping"),
    (b"fault_tolerance:\n  a: [\n", "not valid YAML"),
    (b"fault_tolerance: !!python/object:os.system {}\n", "not valid YAML"),
    (b"[" * 1100, "not valid YAML"),  # deeper than Python's recursion limit
    (b"fault_tolerence:\n  safety_factor: 2\n", "did you mean 'fault_tolerance'"),
    (b"x: '" + b"a" * (agent_config.MAX_YAML_BYTES + 10) + b"'\n", "larger than"),
])
def test_bad_yaml_files_name_the_file(tmp_path, content, error):
    path = yaml_file(tmp_path, content)
    with pytest.raises(ConfigError, match=error) as err:
        build_ft_config(path, {})
    assert str(err.value).startswith(path)
    assert "\n" not in str(err.value)


def test_missing_file_and_directory_name_the_path(tmp_path):
    for path in (str(tmp_path / "nope.yaml"), str(tmp_path)):
        with pytest.raises(ConfigError, match="cannot read") as err:
            build_ft_config(path, {})
        assert str(err.value).startswith(path)
    # NVRx's --ft-ignore-missing-cfg: options and defaults instead.
    ft = build_ft_config(str(tmp_path / "nope.yaml"), {"safety_factor": "2"},
                         ignore_missing_cfg=True)
    assert ft.safety_factor == 2.0


def test_non_utf8_yaml_is_one_error_line_from_the_launcher(tmp_path):
    path = yaml_file(tmp_path, b"fault_tolerance:\n  log_level: \xe9t\xe9\n")
    res = subprocess.run([sys.executable, "-m", "ft_launcher.cli", "--ft-cfg-path", path,
                          "--ft-run-dir", str(tmp_path / "run"), "train.py"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert lines == [f"Error: {path}: not UTF-8 text (byte 30: invalid continuation byte)"]
    assert not (tmp_path / "run").exists()


# -- NVRx keys and flags ---------------------------------------------------------------------

# Every ``fault_tolerance`` key of NVRx 0.4 to 0.7 (from its FaultToleranceConfig).
NVRX_KEYS = [
    "workload_check_interval", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
    "rank_section_timeouts", "rank_out_of_section_timeout", "node_health_check_interval",
    "safety_factor", "rank_termination_signal", "log_level", "restart_check_interval",
    "enable_nic_monitor", "pci_topo_file", "link_down_path_template", "skip_section_response",
    "use_infra_group_rank", "enable_nic_healthcheck", "enable_dist_storage_healthcheck",
    "storage_healthcheck_path", "link_state_path_template", "segment", "numa_bind_strict",
    "gpu_memory_reclaim_timeout", "gpu_memory_tolerance_mb", "gpu_memory_poll_interval",
    "check_remaining_processes", "max_no_progress_cycles", "min_progress_iterations",
    "checkpoint_iteration_file", "install_exception_hook", "num_warmup_iterations",
    "attribution_endpoint", "attribution_stop_action", "attribution_export_url",
    "cycle_info_dir",
]


def test_every_nvrx_key_is_honoured_or_not_applicable():
    known = set(FaultToleranceConfig.parsers()) | set(agent_config.NVRX_NOT_APPLICABLE)
    assert set(NVRX_KEYS) <= known
    assert not set(FaultToleranceConfig.parsers()) & set(agent_config.NVRX_NOT_APPLICABLE)


def test_nvrx_only_keys_warn_once_each_and_are_still_checked(tmp_path, caplog):
    path = yaml_file(tmp_path, "fault_tolerance:\n  workload_check_interval: 5\n"
                               "  enable_nic_monitor: false\n  skip_section_response: true\n"
                               "  log_level: DEBUG\n")
    with caplog.at_level(logging.WARNING):
        ft = build_ft_config(path, {})
        build_ft_config(None, {})  # no file, no warning
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # skip_section_response: true is what happens here
    assert "NVRx setting 'workload_check_interval' is not applicable here (hang detection " \
           "is deadline-driven" in warnings[0]
    assert warnings[0].startswith(f"{path}: fault_tolerance.workload_check_interval: ")
    assert "'enable_nic_monitor'" in warnings[1]
    assert ft.log_level == logging.DEBUG  # honoured
    bad = yaml_file(tmp_path, "fault_tolerance:\n  workload_check_interval: .nan\n", "b.yaml")
    with pytest.raises(ConfigError, match="workload_check_interval: must be a finite number"):
        build_ft_config(bad, {})


def test_a_key_unknown_to_both_is_an_error_with_a_hint(tmp_path):
    path = yaml_file(tmp_path, "fault_tolerance:\n  workload_check_intervall: 5\n")
    with pytest.raises(ConfigError, match="unknown key fault_tolerance.workload_check_intervall "
                                          r"\(did you mean 'workload_check_interval'\?\)"):
        build_ft_config(path, {})


def test_nvrx_values_mean_the_same(tmp_path):
    path = yaml_file(tmp_path, "fault_tolerance:\n  max_no_progress_cycles: 0\n"
                               "  rank_termination_signal: SIGTERM\n  log_level: 30\n"
                               "  rank_section_timeouts: {init: 20, step: null}\n")
    ft = build_ft_config(path, {})
    assert ft.max_no_progress_cycles is None  # NVRx: 0 turns progress tracking off
    assert ft.rank_termination_signal.name == "SIGTERM" and ft.log_level == logging.WARNING
    assert ft.rank_section_timeouts == {"init": 20.0, "step": None}


def test_fault_tolerance_section_may_be_nested_as_in_nvrx(tmp_path):
    path = yaml_file(tmp_path, "model: {layers: 2}\ntrainer:\n  fault_tolerance:\n"
                               "    rank_heartbeat_timeout: 12\n")
    assert load_yaml_section(path) == {"rank_heartbeat_timeout": 12.0}


def _parse_cli(args: list[str]) -> dict:
    ctx = cli.make_context("ft_launcher", [*args, "train.py"])
    return ctx.params


# Every --ft-* flag of NVRx 0.4 to 0.7 that takes a value, with a valid value.
NVRX_VALUE_FLAGS = {
    "--ft-workload-check-interval": "5", "--ft-initial-rank-heartbeat-timeout": "600",
    "--ft-rank-heartbeat-timeout": "60", "--ft-node-health-check-interval": "5",
    "--ft-node-health-check-endpoint": "x", "--ft-safety-factor": "5",
    "--ft-rank-termination-signal": "SIGKILL", "--ft-log-level": "INFO",
    "--ft-rank-out-of-section-timeout": "30", "--ft-rank-section-timeouts": "step:10",
    "--ft-restart-check-interval": "60", "--ft-restart-policy": "min-healthy",
    "--ft-enable-nic-monitor": "false", "--ft-enable-nic-healthcheck": "true",
    "--ft-pci-topo-file": "t", "--ft-link-down-path-template": "t",
    "--ft-link-state-path-template": "t", "--ft-enable-dist-storage-healthcheck": "true",
    "--ft-storage-health-check-path": "/x", "--ft-skip-section-response": "false",
    "--ft-rdzv-impl": "barrier", "--ft-numa-bind-strict": "true",
    "--ft-gpu-memory-reclaim-timeout": "50", "--ft-gpu-memory-tolerance-mb": "512",
    "--ft-gpu-memory-poll-interval": "2", "--ft-check-remaining-processes": "true",
    "--ft-install-exception-hook": "true", "--ft-max-no-progress-cycles": "3",
    "--ft-min-progress-iterations": "1", "--ft-checkpoint-iteration-file": "/x",
    "--ft-use-infra-group-rank": "true", "--ft-segment": "4",
    "--ft-per-cycle-applog-prefix": "/x", "--ft-nvrx-logfile": "/x",
    "--ft-enable-log-server": "true", "--ft-log-server-port": "50051",
    "--ft-log-aggregator-count": "0", "--ft-log-leaf-max-queue-chunks": "-1",
    "--ft-log-server-log-prefix": "/x", "--ft-log-server-graceful-shutdown-timeout": "60",
    "--ft-attribution-endpoint": "localhost", "--ft-attribution-startup-timeout": "10",
    "--ft-attribution-compute-timeout": "10", "--ft-attribution-llm-api-key-file": "/k",
    "--ft-attribution-llm-base-url": "u", "--ft-attribution-llm-model": "m",
    "--ft-attribution-analysis-backend": "b", "--ft-attribution-stop-action": "log",
    "--ft-attribution-log-level": "INFO", "--ft-attribution-export-url": "u",
    "--ft-cycle-info-dir": "/x", "--ft-cycle-info-job-id": "1",
    "--ft-no-restart-exit-code": "3",
}


@pytest.mark.parametrize("flag", sorted(NVRX_VALUE_FLAGS))
def test_every_nvrx_flag_is_accepted_in_each_spelling(flag):
    value = NVRX_VALUE_FLAGS[flag]
    under = "--ft-" + flag[len("--ft-"):].replace("-", "_")
    all_under = "--ft_" + flag[len("--ft-"):].replace("-", "_")
    for spelling in dict.fromkeys([flag, under, all_under]):
        given, not_applicable = ft_flags_given(_parse_cli([spelling, value]))
        honoured = [k for k, v in given.items() if v is not None]
        assert len(honoured) + len(not_applicable) == 1, (spelling, honoured, not_applicable)
        build_ft_config(None, given, not_applicable)  # the value passes its check


def test_nvrx_04_param_spellings_and_cfg_path_alias(tmp_path):
    given, _ = ft_flags_given(_parse_cli(["--ft-param-rank_heartbeat_timeout", "42"]))
    assert build_ft_config(None, given).rank_heartbeat_timeout == 42.0
    _, na = ft_flags_given(_parse_cli(["--ft-param-enable-nic-monitor", "true",
                                       "--ft_param_pci_topo_file", "t"]))
    assert [n.key for n in na] == ["enable_nic_monitor", "pci_topo_file"]
    path = yaml_file(tmp_path, "fault_tolerance:\n  safety_factor: 3\n")
    params = _parse_cli(["--ft-cfg_path", path, "--ft-ignore-missing-cfg"])
    assert params["cfg_path"] == path and params["ignore_missing_cfg"] is True
    with pytest.raises(ConfigError, match="given twice"):
        ft_flags_given(_parse_cli(["--ft-rank-heartbeat-timeout", "1",
                                   "--ft-rank_heartbeat_timeout", "2"]))


def test_not_applicable_flag_warns_naming_it(caplog):
    given, na = ft_flags_given(_parse_cli(["--ft-restart-policy", "min-healthy",
                                           "--ft-workload_check_interval", "5"]))
    with caplog.at_level(logging.WARNING):
        build_ft_config(None, given, na)
    messages = sorted(r.getMessage() for r in caplog.records)
    assert messages[0].startswith("--ft-restart-policy: NVRx setting 'restart-policy' is not "
                                  "applicable here")
    assert messages[1].startswith("--ft-workload-check-interval: NVRx setting")
    # NVRx's default policy is this launcher's behaviour: no warning for it.
    assert ft_flags_given(_parse_cli(["--ft-restart-policy", "any-failed"]))[1] == []
    with pytest.raises(ConfigError, match="--ft-gpu-memory-reclaim-timeout: must be a finite"):
        ft_flags_given(_parse_cli(["--ft-gpu-memory-reclaim-timeout", "inf"]))


def test_every_own_flag_is_documented_in_the_option_table():
    names = {key for _, key, _ in FT_OPTIONS}
    assert {"min_learned_timeout", "learned_timeouts_override", "log_level"} <= names


# -- the agent's FaultToleranceConfig (NVRx's class, for training code) ---------------------


def test_agent_config_reads_nvrx_yaml_files(tmp_path, caplog):
    path = yaml_file(tmp_path, "fault_tolerance:\n    initial_rank_heartbeat_timeout: null\n"
                               "    rank_heartbeat_timeout: null\n"
                               "    rank_section_timeouts:\n        init: 20\n        step: 10\n"
                               "        checkpoint: 30\n    rank_out_of_section_timeout: 30\n"
                               "    log_level: \"DEBUG\"\n    warm_restart: true\n")
    cfg = ft_agent.FaultToleranceConfig.from_yaml_file(path)
    assert type(cfg) is agent_config.FaultToleranceConfig
    assert cfg.rank_section_timeouts == {"init": 20.0, "step": 10.0, "checkpoint": 30.0}
    assert cfg.rank_out_of_section_timeout == 30.0 and cfg.log_level == logging.DEBUG
    assert cfg.initial_rank_heartbeat_timeout is None and cfg.rank_heartbeat_timeout is None
    # A launcher-only key is skipped here (NVRx's ignore_not_recognized=True) ...
    with pytest.raises(ConfigError, match="unknown key fault_tolerance.warm_restart"):
        ft_agent.FaultToleranceConfig.from_yaml_file(path, ignore_not_recognized=False)
    # ... and what the agent writes, the launcher reads.
    out = str(tmp_path / "out.yaml")
    cfg.to_yaml_file(out)
    assert build_ft_config(out, {}).rank_section_timeouts == cfg.rank_section_timeouts
    kw = ft_agent.FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout=5, bogus=1)
    assert kw.rank_heartbeat_timeout == 5.0 and kw.initial_rank_heartbeat_timeout == 600.0
    with pytest.raises(ConfigError, match="rank_heartbeat_timeout: must be a finite"):
        ft_agent.FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout=float("nan"))


def test_agent_config_import_stays_light():
    code = ("import sys, ft_agent\n"
            "assert not {'torch', 'zmq', 'click', 'yaml'} & set(sys.modules)\n"
            "print(ft_agent.FaultToleranceConfig().min_learned_timeout)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "60.0"


def test_the_options_reference_names_every_nvrx_setting():
    """The porting page sends NVRx users to the reference, which must name each setting."""
    from launch_helpers import ROOT

    porting = (ROOT / "docs" / "porting-from-nvrx.md").read_text()
    assert "reference/options.md#nvrx-settings-accepted-without-effect" in porting
    section = (ROOT / "docs" / "reference" / "options.md").read_text()
    for key in [*agent_config.NVRX_NOT_APPLICABLE, *NVRX_KEYS]:
        assert f"`{key}`" in section, key
    for flag in agent_config.NVRX_LAUNCHER_FLAGS_NOT_APPLICABLE:
        parts = flag.split("-")  # families such as --ft-attribution-* are named once
        families = {f"`--ft-{'-'.join(parts[:n])}-*`" for n in range(1, len(parts))}
        assert f"`--ft-{flag}`" in section or any(f in section for f in families), flag


@pytest.mark.parametrize("args", [["--monitor-interval", "nan"], ["--term-timeout", "inf"],
                                  ["--workers-stop-timeout", "-1"],
                                  ["--monitor-interval", "0"]])
def test_torchrun_numbers_are_finite_and_in_range(args):
    import click

    with pytest.raises(click.BadParameter, match="finite|at least") as err:
        _parse_cli(args)
    assert f"'{args[0]}'" in err.value.format_message()
    assert _parse_cli([args[0], "1.5"])[args[0].lstrip("-").replace("-", "_")] == 1.5
