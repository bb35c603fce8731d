"""Learned preloads: the zygote imports what the job's warm workers imported.

Unit tests for the rules (which modules are candidates, the workers' files as untrusted
input, the scan schedule on an injected clock, the book of rounds, the learner's checks in
a real interpreter), and one end-to-end run with a real launcher: a module of a small
package on PYTHONPATH is learned and preloaded for the next cycle and a requeued job, one
that starts a thread at import is refused, and warm restart keeps working.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from launch_helpers import ROOT, SCRIPTS, events, named, run_launcher

from ft_launcher.config import ConfigError, FaultToleranceConfig, parse_ft_value
from ft_launcher.hang.timeouts import TimeoutState, save_state
from ft_launcher.observe.report import preload_lines, preload_rows
from ft_launcher.warm import learned_preloads as lp
from ft_launcher.warm.standby_pool import TickWants, next_tick
from ft_launcher.warm.worker_side import learning

pytestmark = pytest.mark.timeout(120)


# -- which modules a worker records -------------------------------------------------------


def _module(name: str, file: str | None = None, path: list[str] | None = None,
            spec: bool = True):
    mod = type(sys)(name)
    mod.__spec__ = object() if spec else None
    if file is not None:
        mod.__file__ = file
    if path is not None:
        mod.__path__ = path
    return mod


def test_candidates_are_installed_modules_the_script_imported(tmp_path):
    project = tmp_path / "project"  # the working directory, with its own virtualenv in it
    site = project / ".venv" / "lib" / "site-packages"
    other = tmp_path / "elsewhere"  # a PYTHONPATH entry outside the project: installed
    modules = {
        "torch": _module("torch", str(site / "torch" / "__init__.py")),  # the baseline
        "__main__": _module("__main__", str(project / "train.py")),
        "mymodel": _module("mymodel", str(project / "mymodel.py")),  # the user's code
        "mypkg.sub": _module("mypkg.sub", str(project / "mypkg" / "sub.py")),
        "transformers": _module("transformers", str(site / "transformers" / "__init__.py"),
                                [str(site / "transformers")]),
        "transformers.trainer": _module("transformers.trainer",
                                        str(site / "transformers" / "trainer.py")),
        "tinypkg": _module("tinypkg", str(other / "tinypkg" / "__init__.py")),
        "nspkg": _module("nspkg", None, [str(project / "nspkg")]),  # a namespace package
        "_private": _module("_private", str(site / "_private.so")),
        "ft_launcher.warm": _module("ft_launcher.warm", str(other / "ft_launcher")),
        "made.by.hand": _module("made.by.hand", spec=False),  # not importable by name
        "math": _module("math"),  # built in: no file
        "odd name": _module("odd name", str(site / "odd.py")),
        # torch's compiler loads a kernel it compiled as "<hash>.kernel": no such package
        "cabc123.kernel": _module("cabc123.kernel", str(tmp_path / "inductor" / "c.so")),
    }
    found = learning.candidates(modules, {"torch"}, [str(project)], [str(site)])
    assert found == ["transformers", "transformers.trainer", "tinypkg", "math"]


def test_candidates_stop_at_the_limit():
    modules = {f"m{i}": _module(f"m{i}") for i in range(learning.MAX_NAMES + 10)}
    assert len(learning.candidates(modules, set(), [], [])) == learning.MAX_NAMES


def test_a_path_the_script_added_is_its_own_code(tmp_path, monkeypatch):
    """A module found through a sys.path entry the script added after activation is the
    user's code, wherever it lies."""
    code = tmp_path / "src"
    recorder = learning.Recorder(str(tmp_path), 0, [str(tmp_path / "project")])
    monkeypatch.setitem(sys.modules, "added_code_mod",
                        _module("added_code_mod", str(code / "added_code_mod.py")))
    assert "added_code_mod" in recorder.names()
    monkeypatch.setattr(sys, "path", [*sys.path, str(code)])
    assert "added_code_mod" not in recorder.names()


def test_the_worker_writes_its_list_in_one_rename(tmp_path):
    learning.write_names(str(tmp_path), 1, ["a", "b.c"])
    learning.write_names(str(tmp_path), 1, ["a"])
    assert (tmp_path / "learned_1").read_text() == "a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["learned_1"]
    assert (tmp_path / "learned_1").stat().st_mode & 0o777 == 0o600


# -- the workers' files are untrusted -----------------------------------------------------


def test_decode_names_keeps_valid_module_names_only():
    data = (b"transformers\ntransformers.trainer\n../../etc/passwd\nos;rm -rf /\n"
            + b"a" * 300 + b"\n\xff\xfe\x00bin\n_private\nft_launcher.cli\n__main__\n"
            b"  accelerate  \ntransformers\n1abc\nok.\nyaml\r\n")
    assert lp.decode_names(data) == ["transformers", "transformers.trainer", "accelerate",
                                     "yaml"]
    assert lp.decode_names(b"x\n" * (lp.MAX_FILE_BYTES // 2 + 1)) == []  # too big: nothing
    many = "".join(f"m{i}\n" for i in range(learning.MAX_NAMES + 5)).encode()
    assert len(lp.decode_names(many)) == learning.MAX_NAMES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_decode_names_never_raises_and_returns_names(data):
    for name in lp.decode_names(data):
        assert learning.valid_name(name) and not lp.excluded(name)


def test_read_names_file_refuses_links_fifos_and_big_files(tmp_path):
    real = tmp_path / "real"
    real.write_text("json\n")
    assert lp.read_names_file(real) == ["json"]
    (tmp_path / "link").symlink_to(real)
    assert lp.read_names_file(tmp_path / "link") == []
    os.mkfifo(tmp_path / "fifo")  # nobody writes it: a blocking open would hang here
    assert lp.read_names_file(tmp_path / "fifo") == []
    (tmp_path / "big").write_bytes(b"a\n" * lp.MAX_FILE_BYTES)
    assert lp.read_names_file(tmp_path / "big") == []
    assert lp.read_names_file(tmp_path / "missing") == []
    (tmp_path / "learned_0").write_text("b\na\n")
    (tmp_path / "learned_1").write_text("a\nc\n")
    assert lp.read_workers(tmp_path, 2) == ["b", "a", "c"]


# -- when the launcher looks, and what a round holds --------------------------------------


def test_scans_follow_the_latest_activation_on_an_injected_clock():
    scans = lp.ScanClock()
    assert scans.due() is None and not scans.take(1e9)  # no warm worker yet
    first, second, third, fourth, fifth = lp.SCAN_AFTER_S[:5]
    scans.activated(100.0)
    assert scans.due() == 100.0 + first
    assert not scans.take(100.0 + first - 0.1)
    assert scans.take(100.0 + first) and scans.due() == 100.0 + second
    assert scans.take(100.0 + fourth)  # late: one look stands for the ones it missed
    assert scans.due() == 100.0 + fifth
    scans.activated(200.0)  # a restart: the new workers' schedule
    assert scans.due() == 200.0 + first
    for _ in lp.SCAN_AFTER_S:
        assert scans.take(1000.0) or scans.due() is None
    assert scans.due() is None
    wants = TickWants(False, False, False, False, scan_at=200.0 + third)
    assert next_tick(wants, now=201.0, cycle_start=200.0, interval=0.1) == 200.0 + third
    assert next_tick(TickWants(False, False, False, False), 201.0, 200.0, 0.1) is None


def test_the_book_orders_refuses_and_bounds_rounds():
    book = lp.PreloadBook(known={"torch"})
    assert book.offer(["torch", "a.x", "b", "a", "a.y", "_c", "ft_launcher"]) == 4
    assert book.offer(["a", "b", "d"]) == 1
    assert book.can_start()
    assert book.start_round() == ["a", "a.x", "b", "a.y", "d"]  # packages first
    assert not book.can_start() and book.offer(["a.z", "e"]) == 2
    book.on_refused("a", "a reads RANK at import")  # a and what is under it go
    assert book.refused == {"a": "a reads RANK at import"}
    assert book.pending == ["b", "d", "e"] and book.offer(["a.w"]) == 0
    book.start_round()
    assert book.on_learned() == ["b", "d", "e"] and book.known == {"torch", "b", "d", "e"}
    book.offer(["f"])
    book.start_round()
    book.on_refused(None, "the zygote could not be reached")  # nothing to blame: retried
    assert book.pending == ["f"] and book.refused == {"a": "a reads RANK at import"}
    while book.can_start():
        book.start_round()
        book.on_refused(None, "again")
    assert book.failed_rounds == lp.MAX_FAILED_ROUNDS and book.pending == ["f"]


def test_the_state_file_keeps_both_writers_keys(tmp_path):
    path = tmp_path / "ft_state.json"
    book = lp.PreloadBook(learned=["tinypkg", "yaml"], refused={"bad": "its import failed"})
    lp.save_state(path, book)
    save_state(path, TimeoutState(observed={"heartbeat": 1.0}))  # the monitor's, after
    assert lp.load_state(path) == (["tinypkg", "yaml"], {"bad": "its import failed"})
    assert json.loads(path.read_text())["observed"] == {"heartbeat": 1.0}
    path.write_text(json.dumps({"preload": {"learned": ["ok", "../x", 3, "ft_launcher"],
                                            "refused": {"b": 1, "c": "why", "bad name": "x"}}}))
    assert lp.load_state(path) == (["ok"], {"c": "why"})
    for junk in ("[]", "not json", '{"preload": []}', '{"preload": {"learned": "x"}}'):
        path.write_text(junk)
        assert lp.load_state(path) == ([], {})


def test_preload_option_replaces_or_adds_to_the_defaults():
    assert FaultToleranceConfig().preload == ["torch", "torch._dynamo"]
    assert FaultToleranceConfig().preload_learn
    assert parse_ft_value("preload", "json,mypkg", "--ft-preload") == ["json", "mypkg"]
    assert parse_ft_value("preload", "+mypkg, other", "--ft-preload") == [
        "torch", "torch._dynamo", "mypkg", "other"]
    assert parse_ft_value("preload", ["+mypkg"], "preload") == [
        "torch", "torch._dynamo", "mypkg"]
    assert parse_ft_value("preload", "+", "--ft-preload") == ["torch", "torch._dynamo"]
    with pytest.raises(ConfigError, match="--ft-preload: 'my-pkg' is not a module name"):
        parse_ft_value("preload", "+my-pkg", "--ft-preload")
    assert parse_ft_value("preload_learn", "false", "preload_learn") is False


def test_report_lines():
    evs = [{"event": "preload_learned", "modules": ["accelerate", "transformers"],
            "count": 500, "import_s": 2.5, "cpu_s": 2.25},
           {"event": "preload_refused", "module": "lightning",
            "reason": "lightning_fabric.utilities.rank_zero reads RANK at import"},
           {"event": "preload_learned", "modules": ["transformers"], "count": 500,
            "import_s": 2.0, "from_state": True}]
    assert preload_lines(preload_rows(evs)) == [
        "", "Preloads learned: accelerate, transformers (500 modules, imported in 2.500 s, "
        "2.250 s of CPU)",
        "Preload refused: lightning (lightning_fabric.utilities.rank_zero reads RANK at "
        "import)"]
    assert preload_lines(preload_rows([])) == []


# -- the learner's checks, in a real interpreter ------------------------------------------

MODULES = {
    "fine_mod.py": "import socket\n",
    "reads_rank.py": "import os\nRANK = int(os.environ.get('LOCAL_RANK', 0))\n",
    "reads_rank_deep.py": "import reads_rank\n",
    "fails_mod.py": "raise ImportError('needs a GPU')\n",
    "shared_env.py": "import os\nRUN = os.environ.get('FT_RUN_DIR')\n",
    # picks its settings out of the whole environment, as networkx does
    "walks_env.py": "import os\nMINE = {k: v for k, v in os.environ.items() "
                    "if k.startswith('WALKS_')}\nALL = os.environ.copy()\n"
                    "VALUES = list(os.environ.values())\n",
}
LEARN = '''
import gc, json, os, sys  # gc: loaded by the preloads (torch does)
import _socket  # the zygote's own, as after its preloads
from ft_launcher.warm.worker_side import learning, zygote

out = {}
for names in (sys.argv[1:2], sys.argv[2:]):
    imported, forget, refused, _warmed = learning.learn(
        names, {"_socket"}, lambda: zygote.unsafe_reason("its import", "the learner"),
        lambda name: None)
    out[names[0]] = [imported, sorted(forget), refused]
out["environ"] = type(os.environ).__name__
print(json.dumps(out))
'''


@pytest.mark.parametrize("culprit, expected", [
    ("reads_rank_deep", "reads_rank reads LOCAL_RANK at import"),
    ("fails_mod", "ImportError: needs a GPU"),
    ("thread_on_import", "its import started threads (2 threads in the learner"),
])
def test_the_learner_stops_at_a_module_that_would_spoil_the_zygote(tmp_path, culprit,
                                                                      expected):
    """The first call learns a module that needs ``socket``: ``_socket`` is not the zygote's
    own any more. The second stops at the culprit, after the modules before it."""
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    proc = subprocess.run([sys.executable, "-c", LEARN, "fine_mod", "shared_env",
                           "walks_env", culprit, "json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{SCRIPTS}",
                               "FT_RUN_DIR": "/run", "RANK": "0", "MASTER_ADDR": "host"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fine_mod"] == [1, [], None]  # socket imported _socket: the workers' now
    # shared_env reads FT_RUN_DIR, the same in every rank; walks_env reads every variable
    # without naming one: both learned. json: never reached.
    imported, forget, (name, reason) = out["shared_env"]
    assert (imported, forget, name) == (2, ["_socket"], culprit)
    assert reason.startswith(expected)
    assert out["environ"] == "_Environ"  # the watch is gone


# -- the compiler's warm-ups, in a real interpreter ---------------------------------------

WARM = '''
import json, os, subprocess, sys
import torch, torch._dynamo  # the default preloads
from ft_launcher.warm.worker_side import learning, zygote

imported, forget, refused, warmed = learning.learn(
    ["torch._inductor.compile_fx"], set(),
    lambda: zygote.unsafe_reason("its import", "the learner"), lambda name: None)
import torch._inductor.codecache as codecache
import torch._inductor.config as config
import torch._inductor.cpu_vec_isa as isa
from torch._dynamo.utils import compilation_time_metrics

out = {"refused": refused, "warmed": warmed, "threads": len(os.listdir("/proc/self/task")),
       "metrics": sorted(compilation_time_metrics),
       "list_cached": isa.valid_vec_isa_list.cache_info().currsize}
probes = []
run = subprocess.run


def counted(*args, **kwargs):
    probes.append(args)
    return run(*args, **kwargs)


def again(*args, **kwargs):
    raise AssertionError("hashed again")


# What a fork of this learner does at its first compiled step.
subprocess.run, codecache.build_code_hash = counted, again
codecache.torch_key()
if "off" in sys.argv:  # a script that turns vectorization off before it compiles
    config.cpp.vec_isa_ok = False
out["isas"] = [str(i) for i in isa.valid_vec_isa_list()]
out["probes"] = len(probes)
print(json.dumps(out))
'''
FRESH = ("import json, sys, torch._inductor.cpu_vec_isa as isa, torch._inductor.config as c\n"
         "if 'off' in sys.argv: c.cpp.vec_isa_ok = False\n"
         "print(json.dumps([str(i) for i in isa.valid_vec_isa_list()]))")


@pytest.mark.slow  # imports torch's compiler and probes the CPU, four times: ~20 s
@pytest.mark.parametrize("vectorize", ["default", "off"])
def test_the_learner_does_the_compilers_first_use_work_that_forks_inherit(vectorize):
    """Learning torch's compiler also does torch's base check of each vector instruction
    set the CPU has (a compiled probe loaded in a child interpreter each) and hashes
    torch's sources, as a worker's first compiled step would: a fork then probes at most
    what torch checks beyond those, hashes nothing, and finds the sets a fresh process
    finds, also when the script turns vectorization off before it compiles. The hash's
    time is not among the worker's compile times; no thread is left."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the zygote's
    proc = subprocess.run([sys.executable, "-c", WARM, vectorize], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert (out["refused"], out["warmed"]) == (None, ["torch_key", "vector_isas"])
    assert (out["threads"], out["metrics"], out["list_cached"]) == (1, [], 0)
    fresh = subprocess.run([sys.executable, "-c", FRESH, vectorize], capture_output=True,
                           text=True, cwd=ROOT, timeout=120, env=env, check=True)
    assert out["isas"] == json.loads(fresh.stdout)
    if vectorize == "off":
        assert (out["isas"], out["probes"]) == ([], 0)
    else:
        # torch's base check of each set is done; the AVX-512 extras (bf16, VNNI) are not
        sets = [s for s in out["isas"] if s.startswith("avx512")]
        assert out["probes"] <= 2 * len(sets)


# -- end to end ---------------------------------------------------------------------------

TINYPKG = "import time\nLOADED_AT = time.time()\nfrom . import part\n"
SCRIPT = '''
import json, os, sys, time
from pathlib import Path

facts = {"tinypkg": "tinypkg" in sys.modules, "thread": "thread_on_import" in sys.modules}
run_dir = Path(os.environ["FT_RUN_DIR"])
cycle, rank = os.environ["FT_CYCLE"], os.environ["RANK"]
(run_dir / f"facts_{os.environ.get('ATTEMPT', '1')}_{cycle}_{rank}.json").write_text(
    json.dumps(facts))
import tinypkg, thread_on_import
if cycle != "0" or os.environ.get("ATTEMPT") == "2":
    sys.exit(0)
events = run_dir / "events.jsonl"
deadline = time.monotonic() + 60  # rank 1 fails once the zygote learned and the
while time.monotonic() < deadline:  # learned standbys are ready: a restart
    evs = [json.loads(line) for line in events.read_text().splitlines()]
    taken = {p for e in evs if e["event"] == "workers_started" for p in e["pids"]}
    fresh = [e for e in evs if e["event"] == "standby_ready" and e["generation"] > 0
             and e["pid"] not in taken]
    if len(fresh) == 2:
        break
    time.sleep(0.05)
sys.exit(int(rank))
'''


def test_a_module_the_workers_imported_is_preloaded_after_a_restart(tmp_path, run_dir):
    # Installed: on PYTHONPATH, outside the script's directory and the working directory
    # (the repository, which holds tests/scripts).
    pkgs = tmp_path / "pkgs" / "tinypkg"
    pkgs.mkdir(parents=True)
    (pkgs / "__init__.py").write_text(TINYPKG)
    (pkgs / "part.py").write_text("X = 1\n")
    shutil.copy(SCRIPTS / "thread_on_import.py", pkgs.parent)
    script = tmp_path / "work" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    env = {"PYTHONPATH": str(pkgs.parent)}
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--ft-preload", "json", str(script), timeout=90, env=env)
    assert res.returncode == 0, res.stdout[-3000:]
    evs = events(run_dir)
    refused = named(evs, "preload_refused")
    assert [e["module"] for e in refused] == ["thread_on_import"], refused
    assert "started threads" in refused[0]["reason"]
    learned = named(evs, "preload_learned")
    assert learned and "tinypkg" in learned[-1]["modules"], learned
    assert all(e["cpu_s"] >= 0 for e in learned), learned
    assert not any(e["from_state"] for e in learned)
    assert not named(evs, "zygote_fallback") and not named(evs, "warm_restart_disabled")
    started = named(evs, "workers_started")
    assert [e["warm"] for e in started] == [[True, True], [True, True]]
    # Cycle 1's workers are standbys the new zygote forked: tinypkg was there before the
    # script imported it; the module that starts a thread was not.
    generation = {e["pid"]: e["generation"] for e in named(evs, "standby_ready")}
    assert all(generation[p] >= 1 for p in started[1]["pids"])
    facts = {(c, r): json.loads((run_dir / f"facts_1_{c}_{r}.json").read_text())
             for c in (0, 1) for r in (0, 1)}
    assert facts[0, 0] == facts[0, 1] == {"tinypkg": False, "thread": False}
    assert facts[1, 0] == facts[1, 1] == {"tinypkg": True, "thread": False}
    state = json.loads((run_dir / "ft_state.json").read_text())["preload"]
    assert "tinypkg" in state["learned"] and "thread_on_import" in state["refused"]

    # A requeued job on the same run directory preloads it from its first cycle, and
    # does not try the refused module again.
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--ft-preload", "json",
                       str(script), timeout=90, env={**env, "ATTEMPT": "2"})
    assert res.returncode == 0, res.stdout[-3000:]
    again = [e for e in events(run_dir)[len(evs):]]
    assert [e["from_state"] for e in named(again, "preload_learned")] == [True]
    assert not named(again, "preload_refused")
    for rank in (0, 1):
        first = json.loads((run_dir / f"facts_2_0_{rank}.json").read_text())
        assert first == {"tinypkg": True, "thread": False}
