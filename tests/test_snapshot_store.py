"""The node-local snapshot store: round trips bit for bit, double buffering that survives a
torn or corrupted slot and a writer SIGKILLed mid-write (a real child process on tmpfs),
directories and files that are not ours refused, a decoder that raises only SnapshotError
on any bytes (hypothesis), the memory budget, and no pickle anywhere."""

from __future__ import annotations

import ast
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from launch_helpers import freeze, mounted_tmpfs

from ft_agent import snapshot_format as fmt
from ft_agent.snapshot import (
    INLINE_BYTES,
    SnapshotError,
    SnapshotStore,
    available_iterations,
    commit_file,
    latest,
    load,
    slot_file,
)

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
NOBODY = 65534


def same(a, b) -> bool:
    """Bit-identical, recursively (tensors by their bytes, so NaN == NaN)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return (type(b) is dict and list(a) == list(b)
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def rich_state() -> dict:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 5, generator=g)
    return {
        "model": {
            "w": w, "w_t": w.t(),  # non-contiguous
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "f16": torch.randn(3, 2, generator=g).half(),
            "f64": torch.randn(4, dtype=torch.float64, generator=g),
            "c64": torch.randn(3, dtype=torch.complex64, generator=g),
            "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "i64": torch.tensor([2**62, -1]), "u8": torch.arange(256, dtype=torch.uint8),
            "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3), "grad": torch.ones(2, requires_grad=True) * 3,
        },
        "optimizer": {"state": {0: {"step": 12, "exp_avg": torch.zeros(5)}, 1: {}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "name": None}]},
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate()},
        "data": {"epoch": 3, "order": list(range(10)), "done": False, "seed": b"\x00\xffab"},
        "loss": float("nan"), "best": float("inf"), "unicode": "é ∂",
        2.5: "float key", None: "none key", True: "bool key",
    }


def written(store: SnapshotStore, state, iteration: int) -> None:
    status = store.snapshot(state, iteration, wait=True)
    assert status.started, status
    result = store.wait()
    assert result is not None and result.ok and result.iteration == iteration, result


# -- round trip and double buffering ---------------------------------------------------


def test_round_trip_is_bit_identical_and_restores_rng_streams(tmp_path: Path) -> None:
    state = rich_state()
    with SnapshotStore(tmp_path / "rank_0") as store:
        written(store, state, 41)
    snap = load(tmp_path / "rank_0")
    assert snap.iteration == 41 and snap.slot == "a" and snap.rejected == []
    expected = {**state, "model": {**state["model"], "w_t": state["model"]["w_t"].contiguous(),
                                   "grad": state["model"]["grad"].detach()}}
    assert same(expected, snap.state)
    assert not snap.state["model"]["grad"].requires_grad
    # The RNG states really restore the streams.
    torch.set_rng_state(snap.state["rng"]["torch"])
    np.random.set_state(snap.state["rng"]["numpy"])
    random.setstate(snap.state["rng"]["python"])
    after = (torch.rand(3), np.random.rand(3), random.random())
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    assert torch.equal(after[0], torch.rand(3)) and (after[1] == np.random.rand(3)).all()
    assert after[2] == random.random()
    assert stat.S_IMODE(os.stat(tmp_path / "rank_0").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "rank_0" / "slot_a.bin").st_mode) == 0o600


def test_slots_alternate_and_the_newest_checked_one_loads(tmp_path: Path) -> None:
    d = tmp_path / "r"
    with SnapshotStore(d) as store:
        for it in (1, 2, 3):
            written(store, {"w": torch.full((10,), float(it)), "it": it}, it)
    assert available_iterations(d) == [2, 3]
    assert latest(d).iteration == 3 and latest(d).slot == "a"
    assert load(d, iteration=2).state["it"] == 2
    with pytest.raises(SnapshotError) as e:
        load(d, iteration=1)
    assert e.value.reason == "iteration"
    # A store reopened on the same directory carries on writing into the older slot.
    with SnapshotStore(d) as store:
        written(store, {"w": torch.zeros(1), "it": 4}, 4)
    assert available_iterations(d) == [3, 4] and latest(d).slot == "b"


def test_missing_or_empty_directory_has_no_snapshot(tmp_path: Path) -> None:
    assert available_iterations(tmp_path / "nope") == [] and latest(tmp_path / "nope") is None
    SnapshotStore(tmp_path / "empty").close()
    assert available_iterations(tmp_path / "empty") == [] and latest(tmp_path / "empty") is None
    with pytest.raises(SnapshotError) as e:
        load(tmp_path / "empty")
    assert e.value.reason == "none"


def test_roll_back_discards_the_future_and_same_iteration_prefers_the_later_write(
        tmp_path: Path) -> None:
    d = tmp_path / "r"
    with SnapshotStore(d) as store:
        written(store, {"v": 1}, 1)
        written(store, {"v": 2}, 2)
        assert store.discard_newer_than(1) == ["b"]
        assert available_iterations(d) == [1]
        written(store, {"v": "again"}, 2)  # into b, the empty slot
        written(store, {"v": "third"}, 2)  # into a, now the older
    assert available_iterations(d) == [2]
    assert load(d, 2).state == {"v": "third"}


def _two_snapshots(d: Path) -> None:
    with SnapshotStore(d) as store:
        written(store, {"w": torch.arange(1000, dtype=torch.float32), "it": 1}, 1)
        written(store, {"w": torch.arange(1000, dtype=torch.float32) * 2, "it": 2}, 2)


def _tensor_offset(d: Path, slot: str) -> int:
    data = (d / slot_file(slot)).read_bytes()
    header_len = fmt.parse_prefix(data[:fmt.PREFIX.size], len(data))
    return fmt.parse_header(data[fmt.PREFIX.size:fmt.PREFIX.size + header_len],
                            len(data)).tensors[0].offset


def _truncate(d: Path) -> None:
    with open(d / "slot_b.bin", "r+b") as f:
        f.truncate(os.path.getsize(d / "slot_b.bin") - 100)


def _flip_tensor_byte(d: Path) -> None:
    with open(d / "slot_b.bin", "r+b") as f:
        f.seek(_tensor_offset(d, "b") + 17)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def _flip_header_byte(d: Path) -> None:
    with open(d / "slot_b.bin", "r+b") as f:
        f.seek(fmt.PREFIX.size + 3)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x20]))


def _nan_with_matching_checksum(d: Path) -> None:
    """A NaN the checksum cannot see (the commit re-signed over it): only the recorded
    "had no non-finite" flag catches it."""
    off = _tensor_offset(d, "b")
    with open(d / "slot_b.bin", "r+b") as f:
        f.seek(off + 4 * 5)
        f.write(np.array([np.nan], dtype=np.float32).tobytes())
        f.seek(off)
        crc = zlib.crc32(f.read(4000))
    commit = json.loads((d / commit_file("b")).read_text())
    commit["tensors"][0][0] = crc
    (d / commit_file("b")).write_text(json.dumps(commit))


@pytest.mark.parametrize("damage,reason", [
    (_truncate, "truncated"), (_flip_tensor_byte, "checksum"),
    (_flip_header_byte, "checksum"), (_nan_with_matching_checksum, "nonfinite"),
])
def test_a_damaged_newest_slot_is_never_loaded_and_the_previous_one_is(
        tmp_path: Path, damage, reason: str) -> None:
    d = tmp_path / "r"
    _two_snapshots(d)
    damage(d)
    snap = load(d)
    assert snap.iteration == 1 and same(snap.state["w"], torch.arange(1000.0))
    assert [(s, r.split(":")[0]) for s, r in snap.rejected] == [("b", reason)]
    with pytest.raises(SnapshotError) as e:
        load(d, iteration=2)
    assert e.value.reason == "iteration" and e.value.rejected[0][1].startswith(reason)


def test_nonfinite_values_present_at_snapshot_time_load(tmp_path: Path) -> None:
    w = torch.tensor([1.0, float("nan"), float("-inf")])
    with SnapshotStore(tmp_path / "r") as store:
        written(store, {"w": w}, 5)
    assert same(load(tmp_path / "r").state["w"], w)


# -- a writer killed mid-write ----------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, torch
    from ft_agent.snapshot import SnapshotStore
    store = SnapshotStore(sys.argv[1])
    it = 0
    while True:
        it += 1
        # ~50 MB in 50 tensors, every value a function of the iteration
        state = {"it": it, "w": [torch.full((250_000,), float(it * 100 + k)) for k in range(50)]}
        store.snapshot(state, it, wait=True)
        if it == 2:
            store.wait()
            print("ready", flush=True)
""")


def test_writer_sigkilled_mid_write_leaves_the_previous_snapshot_whole() -> None:
    d = Path(tempfile.mkdtemp(prefix="ft-snaptest-", dir="/dev/shm")) / "rank_0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(d)], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        # Freeze the writer at random moments until one lands inside a write (a slot's
        # commit record is gone from the start of its write until its rename), then kill.
        deadline = time.monotonic() + 30
        torn = None
        while torn is None and time.monotonic() < deadline:
            time.sleep(random.uniform(0, 0.02))
            freeze(child.pid)
            missing = [s for s in "ab" if not (d / commit_file(s)).exists()]
            if missing:
                child.kill()
                torn = missing[0]
            else:
                child.send_signal(signal.SIGCONT)
        assert torn is not None, "never caught the writer mid-write"
        child.wait(10)
        whole = "b" if torn == "a" else "a"
        iterations = available_iterations(d)
        assert len(iterations) == 1
        snap = load(d)
        assert snap.slot == whole and snap.iteration == iterations[0] and snap.rejected == []
        it = snap.iteration
        assert snap.state["it"] == it and len(snap.state["w"]) == 50
        for k, t in enumerate(snap.state["w"]):
            assert torch.equal(t, torch.full((250_000,), float(it * 100 + k))), k
        # The torn slot's file is there, half new; without its commit it is never trusted.
        assert (d / slot_file(torn)).exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
        shutil.rmtree(d.parent, ignore_errors=True)


# -- directories and files that are not ours --------------------------------------------


def test_directory_with_wrong_mode_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "r"
    _two_snapshots(d)
    os.chmod(d, 0o755)
    for call in (lambda: SnapshotStore(d), lambda: load(d), lambda: available_iterations(d)):
        with pytest.raises(SnapshotError) as e:
            call()
        assert e.value.reason == "mode" and "755" in str(e.value)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to chown to another user")
def test_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "r"
    _two_snapshots(d)
    os.chown(d, NOBODY, NOBODY)
    for call in (lambda: SnapshotStore(d), lambda: load(d), lambda: available_iterations(d)):
        with pytest.raises(SnapshotError) as e:
            call()
        assert e.value.reason == "owner" and str(NOBODY) in str(e.value)


def test_symlinked_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "r"
    _two_snapshots(d)
    (tmp_path / "link").symlink_to(d)
    for call in (lambda: SnapshotStore(tmp_path / "link"), lambda: load(tmp_path / "link")):
        with pytest.raises(SnapshotError) as e:
            call()
        assert e.value.reason == "symlink"


def test_symlinked_fifo_or_foreign_files_in_the_directory_are_not_loaded(
        tmp_path: Path) -> None:
    d = tmp_path / "r"
    _two_snapshots(d)
    os.replace(d / "slot_b.bin", tmp_path / "elsewhere.bin")
    (d / "slot_b.bin").symlink_to(tmp_path / "elsewhere.bin")
    (d / commit_file("a")).unlink()
    os.mkfifo(d / commit_file("a"))  # must not block the reader
    with pytest.raises(SnapshotError) as e:
        load(d)
    assert e.value.reason == "none"
    reasons = {s: r.split(":")[0] for s, r in e.value.rejected}
    assert reasons == {"a": "not_a_file", "b": "symlink"}
    if IS_ROOT:
        _two_snapshots(tmp_path / "q")
        os.chown(tmp_path / "q" / "slot_b.bin", NOBODY, NOBODY)
        snap = load(tmp_path / "q")
        assert snap.iteration == 1 and snap.rejected[0][1].startswith("owner")


# -- the decoder on hostile bytes -------------------------------------------------------


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory) -> tuple[bytes, bytes]:
    d = tmp_path_factory.mktemp("valid") / "r"
    with SnapshotStore(d) as store:
        written(store, {"w": torch.arange(40.0).reshape(4, 10), "n": [1, (2, b"x")],
                        "h": torch.arange(6, dtype=torch.bfloat16), 3: {"k": 1.5}}, 9)
    return (d / "slot_a.bin").read_bytes(), (d / commit_file("a")).read_bytes()


def _load_only_snapshot_errors(tmp_path: Path, slot: bytes, commit: bytes) -> None:
    d = tmp_path / f"h{random.getrandbits(48)}"
    d.mkdir(mode=0o700)
    try:
        (d / "slot_a.bin").write_bytes(slot)
        (d / commit_file("a")).write_bytes(commit)
        try:
            snap = load(d)
        except SnapshotError:
            pass
        else:
            assert snap.iteration == json.loads(commit)["iteration"]
        available_iterations(d)  # raises nothing on any bytes in the files
    finally:
        shutil.rmtree(d)


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(slot=st.binary(max_size=400), commit=st.binary(max_size=200))
def test_random_bytes_raise_only_snapshot_error(tmp_path: Path, slot, commit) -> None:
    _load_only_snapshot_errors(tmp_path, slot, commit)


@SETTINGS
@given(data=st.data())
def test_damaged_valid_files_raise_only_snapshot_error(tmp_path: Path, valid_files,
                                                       data) -> None:
    slot, commit = (bytearray(b) for b in valid_files)
    target = data.draw(st.sampled_from(["slot", "commit", "both"]))
    for name, buf in (("slot", slot), ("commit", commit)):
        if target in (name, "both"):
            for _ in range(data.draw(st.integers(1, 4))):
                i = data.draw(st.integers(0, len(buf) - 1))
                buf[i] = data.draw(st.integers(0, 255))
            if data.draw(st.booleans()):
                del buf[data.draw(st.integers(0, len(buf))):]
    _load_only_snapshot_errors(tmp_path, bytes(slot), bytes(commit))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["t", "n", "b", "d", "u", "f", "x"]), kids, max_size=2),
    max_leaves=20)


@SETTINGS
@given(tree=JSON, tensors=st.lists(st.lists(JSON, max_size=5), max_size=3))
def test_arbitrary_headers_parse_or_raise_snapshot_error(tree, tensors) -> None:
    body = json.dumps({"iteration": 1, "byteorder": sys.byteorder, "tree": tree,
                       "tensors": tensors}).encode()
    try:
        header = fmt.parse_header(body, 1 << 20)
        fmt.decode_tree(header.tree, [torch.zeros(1)] * len(header.tensors))
    except SnapshotError:
        pass


# -- cost controls ----------------------------------------------------------------------


def test_over_the_memory_budget_is_skipped_and_writes_nothing(tmp_path: Path) -> None:
    d = tmp_path / "r"
    # 4000 bytes: a slot file of 4000 + its header (padded to 4 KiB), about 8.2 KB
    state = {"w": torch.zeros(1000)}
    with SnapshotStore(d, memory_budget=20_000) as store:
        written(store, state, 1)  # slot a's file <= budget
        written(store, state, 2)  # slot b's file + slot a's file <= budget
        status = store.snapshot({"w": torch.zeros(2000)}, 3)  # 8000 + a's file > budget
        assert not status.started and status.reason == "budget" and status.bytes == 8000
        assert store.wait().iteration == 2
    assert available_iterations(d) == [1, 2]


def test_the_other_slot_is_claimed_in_the_background_within_the_budget(
        tmp_path: Path) -> None:
    state = {"w": torch.ones(1000)}
    d = tmp_path / "r"
    with SnapshotStore(d) as store:
        written(store, state, 1)
        a, b = (os.stat(d / f"slot_{s}.bin") for s in "ab")
        # Claimed after slot a's commit, so the next step does not wait for it.
        assert b.st_size == a.st_size and b.st_blocks * 512 >= b.st_size
        written(store, state, 2)
        assert os.stat(d / "slot_b.bin").st_ino == b.st_ino
    assert available_iterations(d) == [1, 2]
    one_slot = os.stat(d / "slot_a.bin").st_size
    with SnapshotStore(tmp_path / "s", memory_budget=2 * one_slot - 1) as store:
        written(store, state, 1)
        assert not (tmp_path / "s" / "slot_b.bin").exists()


def test_a_growing_value_beside_the_tensors_reuses_the_claimed_slots(tmp_path: Path) -> None:
    """A trainer's state carries values that grow every few steps (a log history): the
    slot files keep their size, so no snapshot is skipped to claim memory again."""
    d = tmp_path / "r"
    w = torch.ones(1000)
    with SnapshotStore(d) as store:
        written(store, {"w": w, "log": []}, 1)
        store.wait()  # the second slot, claimed after the first commit
        for i in range(2, 40):
            status = store.snapshot({"w": w, "log": [{"step": s, "loss": 1 / (s + 1)}
                                                     for s in range(i)]}, i)
            assert status.started, status
            store.wait()
        sizes = {os.stat(d / f"slot_{s}.bin").st_size for s in "ab"}
    assert len(sizes) == 1 and load(d).state["log"][-1]["step"] == 38


def test_one_write_in_flight_a_second_is_skipped_as_busy_or_waits(tmp_path: Path) -> None:
    big = {"w": torch.ones(5_000_000)}  # 20 MB: its check outlasts the next call by far
    with SnapshotStore(tmp_path / "r") as store:
        # A slot's memory is claimed in the background: the step never waits for it.
        claiming = store.snapshot(big, 1)
        assert not claiming.started and claiming.reason == "claim"
        assert store.snapshot(big, 1).reason == "busy"  # the claim is still running
        store.wait()
        first = store.snapshot(big, 1)
        second = store.snapshot(big, 2)
        assert first.started and not second.started and second.reason == "busy"
        third = store.snapshot(big, 3, wait=True)
        assert third.started and third.slot == "b"
        assert store.wait().ok
    assert available_iterations(tmp_path / "r") == [1, 3]


def test_a_small_state_is_committed_inside_the_call_a_large_one_in_the_background(
        tmp_path: Path) -> None:
    """A short step would pay more for a thread's start, and for handing it the interpreter's
    lock, than for the checks of a small state: up to INLINE_BYTES they run in the call."""
    seen: list[tuple[int, bool]] = []
    here = threading.get_ident()
    for name, state in [("small", {"w": torch.ones(1000), "step": 1}),
                        ("large", {"w": torch.ones(INLINE_BYTES // 4 + 1)})]:
        d = tmp_path / name
        with SnapshotStore(d, on_commit=lambda r: seen.append((threading.get_ident(),
                                                               r.inline))) as store:
            written(store, state, 1)
            store.wait()  # the second slot's claim
            seen.clear()
            assert store.snapshot(state, 2).started
            if name == "small":  # nothing to wait for: committed and reported already
                assert available_iterations(d) == [1, 2] and seen == [(here, True)]
            else:
                assert store.wait().ok and seen and seen[0][0] != here and not seen[0][1]
                assert available_iterations(d) == [1, 2]


@pytest.mark.parametrize("bad,where", [
    ({"x": {1, 2}}, "state['x']"), ({"m": [object()]}, "state['m'][0]"),
    ({"f8": torch.zeros(2).to(torch.float8_e4m3fn)}, "tensor 0"),
    ({(1, 2): 3}, "key (1, 2)"),
])
def test_unsupported_state_is_refused_naming_where(tmp_path: Path, bad, where: str) -> None:
    with SnapshotStore(tmp_path / "r") as store:
        with pytest.raises(SnapshotError) as e:
            store.snapshot(bad, 1)
        assert e.value.reason == "unsupported" and where in str(e.value)
        assert store.last_write is None


@pytest.fixture
def full_tmpfs():
    """A real 1 MiB tmpfs (root only), unmounted at teardown."""
    yield from mounted_tmpfs("1m", mode="0700", prefix="ft_snap_tmpfs_")


def test_full_tmpfs_skips_the_snapshot_and_keeps_the_previous_one(full_tmpfs: Path,
                                                                  caplog) -> None:
    d = full_tmpfs / "rank_0"
    with SnapshotStore(d) as store:
        written(store, {"w": torch.ones(50_000)}, 1)  # 200 kB
        # 1.2 MB: no room. The slot's pages are claimed before the copy, so this is a skip
        # and not a SIGBUS in the middle of it.
        status = store.snapshot({"w": torch.ones(300_000)}, 2)
        assert not status.started and status.reason == "claim"
        store.wait()  # the claim fails in the background; the next snapshot says so
        status = store.snapshot({"w": torch.ones(300_000)}, 2)
        assert not status.started and status.reason == "io"
        assert "No space left" in caplog.text
        written(store, {"w": torch.ones(40_000)}, 3)  # room again: it goes on
    assert available_iterations(d) == [1, 3] and load(d).iteration == 3


# -- no pickle ------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["ft_agent/snapshot.py", "ft_agent/snapshot_format.py"])
def test_no_pickle_anywhere(module: str) -> None:
    tree = ast.parse((ROOT / module).read_text())
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
              "joblib"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & banned
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in banned
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) not in {("torch", "load"), ("torch", "save"),
                                                      ("np", "load"), ("numpy", "load")}


def _nested(depth: int):
    value = torch.ones(1)
    for level in range(depth):
        value = [value] if level % 3 == 0 else ((value,) if level % 3 == 1 else {"k": value})
    return value


def test_nesting_the_writer_accepts_the_reader_accepts_and_deeper_is_refused(
        tmp_path: Path) -> None:
    deepest = _nested(fmt.MAX_DEPTH)
    with SnapshotStore(tmp_path / "r") as store:
        written(store, deepest, 1)
        with pytest.raises(SnapshotError) as e:
            store.snapshot(_nested(fmt.MAX_DEPTH + 1), 2)
        assert e.value.reason == "unsupported" and "deeper" in str(e.value)
    assert same(load(tmp_path / "r").state, deepest)


DTYPE_NAMES = sorted(fmt.DTYPES)


@st.composite
def tensors(draw):
    dtype = fmt.DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    data = draw(st.binary(min_size=n, max_size=n))
    if dtype == torch.bool:  # a bool's byte is 0 or 1 (torch's copies normalise others)
        data = bytes(b & 1 for b in data)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape) \
        if n else torch.empty(shape, dtype=dtype)


KEYS = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4)
STATES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63 + 1, 2**63 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8) | tensors(),
    lambda kids: st.lists(kids, max_size=3) | st.tuples(kids, kids)
    | st.dictionaries(KEYS, kids, max_size=3),
    max_leaves=12)


@SETTINGS
@given(state=STATES)
def test_any_supported_state_round_trips_bit_for_bit(tmp_path: Path, state) -> None:
    d = tmp_path / f"p{random.getrandbits(48)}"
    try:
        with SnapshotStore(d) as store:
            written(store, state, 3)
        assert same(state, load(d).state)
    finally:
        shutil.rmtree(d, ignore_errors=True)
