"""Prometheus metrics: a real exporter on a real port, scraped over HTTP and parsed with
prometheus_client's own parser; and a scrape during a real run with a fault."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from launch_helpers import NO_PRELOADS
from prometheus_client.parser import text_string_to_metric_families
from test_ledger import T0, Stream, killed_then_finished

from ft_launcher.cli import build_ft_config
from ft_launcher.config import ConfigError
from ft_launcher.observe.metrics import MetricsError, MetricsExporter


def scrape(address: tuple[str, int]) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


@pytest.fixture
def exporter():
    ex = MetricsExporter("127.0.0.1", 0)  # 0: the system picks a free port
    yield ex
    ex.close()


def test_figures_of_a_recorded_run(exporter: MetricsExporter):
    exporter.set_heartbeat_ages(lambda: {0: 0.25, 1: 1.5})
    for record in killed_then_finished().records:
        exporter.observe(record)
    m = scrape(exporter.address)
    assert all(name.startswith("ft_") for name, _ in m if not name.startswith(
        ("python_", "process_"))), sorted({n for n, _ in m})
    assert m[("ft_cycle", ())] == 1 and m[("ft_attempt", ())] == 1
    assert m[("ft_restarts_total", (("cause", "failed"),))] == 1
    assert m[("ft_workers_alive", ())] == 0
    assert m[("ft_last_detection_latency_seconds", ())] == pytest.approx(0.1)
    assert m[("ft_goodput", ())] == pytest.approx(0.604, abs=1e-3)
    assert m[("ft_productive_seconds", ())] == pytest.approx(15.1)
    assert m[("ft_wall_seconds", ())] == pytest.approx(25.0)
    assert m[("ft_lost_seconds", (("phase", "work_lost"),))] == pytest.approx(1.5)
    assert m[("ft_last_step", ())] == 200
    assert m[("ft_seconds_since_heartbeat", (("rank", "0"),))] == 0.25
    assert m[("ft_seconds_since_heartbeat", (("rank", "1"),))] == 1.5
    assert not any(name.startswith("ft_hang_verdicts_total") for name, _ in m)


def test_live_figures_move_with_the_run(exporter: MetricsExporter):
    ages = {0: 0.0}
    exporter.set_heartbeat_ages(lambda: dict(ages))
    shift = time.time() - 10 - T0  # the launcher started 10 s ago; training 3 s after it
    for record in killed_then_finished().records[:8]:
        exporter.observe({**record, "ts": record["ts"] + shift})
    first = scrape(exporter.address)
    assert first[("ft_workers_alive", ())] == 2 and first[("ft_cycle", ())] == 0
    assert first[("ft_wall_seconds", ())] == pytest.approx(10, abs=1.0)
    assert first[("ft_goodput", ())] == pytest.approx(0.7, abs=0.05)
    ages[0] = 7.5
    exporter.progress(0, 42)
    time.sleep(0.5)
    second = scrape(exporter.address)
    assert second[("ft_last_step", ())] == 42
    assert second[("ft_seconds_since_heartbeat", (("rank", "0"),))] == 7.5
    # Figures that change with time are computed at each scrape.
    assert second[("ft_wall_seconds", ())] >= first[("ft_wall_seconds", ())] + 0.5
    assert second[("ft_goodput", ())] > first[("ft_goodput", ())]


def test_hang_verdicts_by_timeout_kind_and_bounded_labels(exporter: MetricsExporter):
    s = Stream()
    s.at(0, "launcher_started").at(0, "workers_started", ranks=[0, 1])
    s.at(5, "hang_detected", rank=1, timeout_kind="heartbeat", silence_s=2.0)
    s.at(5.2, "worker_exited", rank=1, signal="SIGKILL")
    s.at(5.3, "decision", outcome="hung").restart(5.4)
    for record in s.records:
        exporter.observe(record)
    m = scrape(exporter.address)
    assert m[("ft_hang_verdicts_total", (("timeout_kind", "heartbeat"),))] == 1
    assert m[("ft_restarts_total", (("cause", "hung"),))] == 1
    assert m[("ft_last_detection_latency_seconds", ())] == pytest.approx(2.0)  # the silence
    for i in range(100):  # a flood of distinct kinds stays within MAX_LABEL_VALUES
        exporter.observe({"ts": T0 + 6 + i, "event": "hang_detected", "cycle": 1, "rank": 0,
                          "timeout_kind": f"section:s{i}", "silence_s": 1.0})
    m = scrape(exporter.address)
    kinds = {dict(labels)["timeout_kind"] for name, labels in m
             if name == "ft_hang_verdicts_total"}
    assert len(kinds) == 33 and "other" in kinds
    assert m[("ft_hang_verdicts_total", (("timeout_kind", "other"),))] == 100 - 31


def test_broken_input_never_breaks_a_scrape(exporter: MetricsExporter):
    def boom():
        raise RuntimeError("launcher state changed under us")
    exporter.set_heartbeat_ages(boom)
    for bad in [None, {"event": "restart"}, {"ts": "x", "event": "a", "cycle": 0},
                {"ts": T0, "event": "worker_exited", "cycle": 0, "rank": [1]}]:
        exporter.observe(bad)
    m = scrape(exporter.address)
    assert m[("ft_cycle", ())] == 0
    assert not any(name == "ft_seconds_since_heartbeat" for name, _ in m)


def test_binds_loopback_by_default_and_frees_its_port():
    ex = MetricsExporter(port=0)
    host, port = ex.address
    assert host == "127.0.0.1"
    with pytest.raises(MetricsError, match=rf"--ft-metrics-port {port} on 127.0.0.1: .*in use"):
        MetricsExporter("127.0.0.1", port)
    ex.close()
    with socket.socket() as s:  # closed: the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("flag,value,error", [
    ("metrics_port", "0", "--ft-metrics-port: must be in [1, 65535]"),
    ("metrics_port", "70000", "--ft-metrics-port: must be in [1, 65535]"),
    ("metrics_port", "http", "--ft-metrics-port: expected an integer"),
    ("metrics_addr", "", "--ft-metrics-addr: expected an address"),
    ("status_interval", "nan", "--ft-status-interval: must be a finite number"),
    ("status_interval", "-1", "--ft-status-interval: must be at least 0"),
    ("status_interval", "inf", "--ft-status-interval: must be a finite number"),
])
def test_options_are_validated(flag: str, value: str, error: str):
    with pytest.raises(ConfigError) as exc:
        build_ft_config(None, {flag: value})
    assert str(exc.value).startswith(error)


def test_option_defaults():
    ft = build_ft_config(None, {"metrics_port": "9400", "status_interval": "0"})
    assert (ft.metrics_port, ft.metrics_addr, ft.status_interval) == (9400, "127.0.0.1", 0.0)
    assert build_ft_config(None, {}).status_interval == 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCRIPT = Path(__file__).parent / "scripts" / "progress_then_killed.py"


@pytest.mark.slow
def test_scrape_during_run(tmp_path: Path, run_dir: Path):
    """Scrapes a real launcher while a rank is killed and the group restarts. Needs the
    supervisor's wiring of --ft-metrics-port (MetricsExporter, observe per event)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ft_launcher.cli", "--ft-run-dir", str(run_dir), *NO_PRELOADS,
         "--nproc-per-node", "2", "--max-restarts", "1", "--workers-stop-timeout", "2",
         "--ft-metrics-port", str(port), str(SCRIPT), "--marks", str(tmp_path / "marks"),
         "--steps", "100", "--ckpt-step", "20", "--kill-after", "1.0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[dict] = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                seen.append(scrape(("127.0.0.1", port)))
            except OSError:
                pass  # not serving yet, or already closed
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert seen, "never scraped"
    before = [m for m in seen if m.get(("ft_cycle", ())) == 0]
    after = [m for m in seen if m.get(("ft_cycle", ())) == 1]
    assert before and after, json.dumps([m.get(("ft_cycle", ())) for m in seen])
    assert any(m.get(("ft_workers_alive", ())) == 2 for m in before)
    assert all(m.get(("ft_restarts_total", (("cause", "failed"),)), 0) == 0 for m in before)
    assert any(m.get(("ft_restarts_total", (("cause", "failed"),))) == 1 for m in after)
    assert any(0 <= m.get(("ft_last_detection_latency_seconds", ()), -1) < 1.0 for m in after)
    ages = [v for m in after for (name, labels), v in m.items()
            if name == "ft_seconds_since_heartbeat"]
    assert ages and all(0 <= a < 30 for a in ages)
    assert any(0 < m.get(("ft_goodput", ()), 0) <= 1 for m in after)
