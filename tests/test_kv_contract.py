"""The ``KeyValue`` contract (``ft_launcher.nodes.kv``), one set of cases run on both engines:
``C10dKV`` over a real in-process TCPStore (fast tier) and ``EtcdKV`` over a real 3-member
etcd cluster (slow tier); then what only etcd has (a campaign for a key held by a lease, a
leader killed mid-use, the whole cluster gone), its options, and its decoder against
hostile answers from a real socket."""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import store_fixtures
from hypothesis import given, settings
from hypothesis import strategies as st
from store_fixtures import EtcdCluster, require_etcd, running_etcd

from ft_launcher.config import ConfigError
from ft_launcher.nodes import kv_etcd
from ft_launcher.nodes.kv import C10dKV, KeyValue, StoreUnreachable, connect
from ft_launcher.nodes.kv_etcd import EtcdKV, EtcdRefused, NotACounter
from ft_launcher.nodes.rendezvous import RendezvousError

etcd3_cluster = store_fixtures.etcd3_cluster  # the fixture: a cluster of its own per test

REQUEST_TIMEOUT_S = 10.0  # the contract's clients: generous, a loaded machine is not a fault
WAKE_BOUND_S = 5.0  # a wait woken by a put returns within this after the put (generous)


# -- the two engines -------------------------------------------------------------------------


@dataclass
class Engine:
    """Makes clients of one store, each under a prefix; closes them all at teardown."""

    name: str
    make: Callable[[str], KeyValue]
    job: str = field(default_factory=lambda: f"/ft_launcher/test-{uuid.uuid4().hex[:12]}")
    clients: list[KeyValue] = field(default_factory=list)

    def client(self, rdzv_id: str = "job") -> KeyValue:
        kv = self.make(f"{self.job}-{rdzv_id}/")
        self.clients.append(kv)
        return kv

    def close(self) -> None:
        for kv in self.clients:
            kv.close()


@pytest.fixture(scope="module")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One cluster for the cases that only read and write keys (each under its own job
    prefix); the cases that kill members start their own (``etcd3_cluster``)."""
    require_etcd("etcd3gw")
    with running_etcd(tmp_path_factory.mktemp("etcd") / "etcd") as cluster:
        yield cluster


def etcd_client(cluster: EtcdCluster, prefix: str, timeout: float = REQUEST_TIMEOUT_S,
                first: int = 0) -> EtcdKV:
    """A client whose endpoint list starts at member ``first`` (the one it asks first)."""
    ports = cluster.client_ports[first:] + cluster.client_ports[:first]
    return EtcdKV.from_endpoint(",".join(f"127.0.0.1:{p}" for p in ports), prefix, timeout, {})


@contextlib.contextmanager
def c10d_engine() -> Iterator[Engine]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=REQUEST_TIMEOUT_S))

    def make(prefix: str) -> KeyValue:
        return C10dKV(dist.PrefixStore(prefix, connect("127.0.0.1", server.port,
                                                       REQUEST_TIMEOUT_S)))

    engine = Engine("c10d", make)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(params=["c10d", pytest.param("etcd", marks=pytest.mark.slow)])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    if request.param == "c10d":
        with c10d_engine() as eng:
            yield eng
        return
    cluster = request.getfixturevalue("shared_etcd")
    eng = Engine("etcd", lambda prefix: etcd_client(cluster, prefix))
    try:
        yield eng
    finally:
        eng.close()


def together(*fns: Callable[[], object], timeout: float = 60) -> list[object]:
    """Run each of ``fns`` in a thread of its own, all at once; their results, in order
    (the first error raised again here). The threads are joined before it returns."""
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout) for f in futures]


def timed_end(fn: Callable[[], object]) -> Callable[[], tuple[object, float]]:
    """``fn`` that also gives the monotonic time it returned at."""
    return lambda: (fn(), time.monotonic())


# -- the contract ----------------------------------------------------------------------------


def test_get_set_and_a_missing_key(engine: Engine) -> None:
    kv = engine.client()
    assert kv.get("nothing") is None
    kv.set("k", b"one")
    assert kv.get("k") == b"one"
    kv.set("k", b"\x00\xff two")  # any bytes, overwritten
    assert kv.get("k") == b"\x00\xff two"
    other = engine.client()
    assert other.get("k") == b"\x00\xff two"  # another client reads what this one wrote


def test_multi_get_gives_none_for_missing_keys(engine: Engine) -> None:
    kv = engine.client()
    kv.set("a", b"1")
    kv.set("c", b"3")
    assert kv.multi_get(["a", "b", "c", "a"]) == [b"1", None, b"3", b"1"]
    assert kv.multi_get(["x", "y"]) == [None, None]
    assert kv.multi_get([]) == []


def test_create_lets_the_first_of_two_clients_win(engine: Engine) -> None:
    a, b = engine.client(), engine.client()
    start = threading.Barrier(2)

    def create(kv: KeyValue, value: bytes) -> bytes:
        start.wait(10)
        return kv.create("first", value)

    got_a, got_b = together(lambda: create(a, b"a"), lambda: create(b, b"b"))
    assert got_a == got_b in (b"a", b"b")  # both see the one winner
    assert a.create("first", b"late") == got_a
    assert b.get("first") == got_a


def test_add_from_several_clients_sums_exactly(engine: Engine) -> None:
    threads, adds = 4, 15
    clients = [engine.client() for _ in range(threads)]
    start = threading.Barrier(threads)

    def count(kv: KeyValue) -> list[int]:
        start.wait(10)
        return [kv.add("counter", 1) for _ in range(adds)]

    seen = [n for got in together(*(lambda kv=kv: count(kv) for kv in clients)) for n in got]
    assert sorted(seen) == list(range(1, threads * adds + 1))  # each add saw its own total
    assert clients[0].add("counter", 0) == threads * adds
    assert clients[0].add("counter", -5) == threads * adds - 5


def test_wait_returns_at_once_when_the_key_exists(engine: Engine) -> None:
    kv = engine.client()
    kv.set("ready", b"yes")
    t0 = time.monotonic()
    assert kv.wait("ready", 60) == b"yes"
    assert time.monotonic() - t0 < 5  # not the 60 s


def test_wait_wakes_on_a_put_from_another_client(engine: Engine) -> None:
    waiter, writer = engine.client(), engine.client()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(timed_end(lambda: waiter.wait("go", 60)))
        time.sleep(0.5)  # let the waiter reach its watch; a put before it is caught all the same
        assert not waiting.done(), f"the wait returned before the put: {waiting.result()}"
        t_put = time.monotonic()
        writer.set("go", b"now")
        value, t_end = waiting.result(60)
    assert value == b"now"
    woke_s = t_end - t_put
    print(f"\n{engine.name}: wait woken {woke_s * 1000:.1f} ms after the put")
    assert woke_s < WAKE_BOUND_S


def test_wait_returns_none_at_its_timeout(engine: Engine) -> None:
    kv = engine.client()
    t0 = time.monotonic()
    assert kv.wait("never", 1.0) is None
    took = time.monotonic() - t0
    assert 1.0 <= took < 1.0 + 5, took


def _member_connections(ports: list[int]) -> list:
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED]


def test_wait_leaves_no_thread_or_stream_behind(engine: Engine, request) -> None:
    before = set(threading.enumerate())
    kv, writer = engine.client(), engine.client()
    assert kv.wait("absent", 0.5) is None  # timed out
    writer.set("present", b"1")
    assert kv.wait("present", 5) == b"1"  # at once
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lambda: kv.wait("later", 60))
        time.sleep(0.3)
        writer.set("later", b"2")
        assert waiting.result(60) == b"2"  # woken
    assert set(threading.enumerate()) - before == set()
    if engine.name == "etcd":
        # Closed clients hold no connection: an open watch stream would still be one.
        cluster = request.getfixturevalue("shared_etcd")
        kv.close()
        writer.close()
        assert _member_connections(cluster.client_ports) == []


def test_prefixes_keep_two_rendezvous_apart(engine: Engine) -> None:
    one, two = engine.client("job1"), engine.client("job10")
    one.set("k", b"one")
    assert two.get("k") is None
    two.set("k", b"two")
    assert one.get("k") == b"one"
    assert one.create("c", b"1") == b"1"
    assert two.create("c", b"2") == b"2"
    assert one.add("n", 5) == 5
    assert two.add("n", 1) == 1
    assert two.multi_get(["k", "c", "n"]) == [b"two", b"2", b"1"]
    one.set("only-in-one", b"x")
    assert two.wait("only-in-one", 0.5) is None  # a put under another prefix wakes nobody


# -- etcd only: leases, failover, options, hostile answers ----------------------------------

def _job() -> str:
    return f"/ft_launcher/test-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def etcd_pair(shared_etcd: EtcdCluster) -> Iterator[tuple[EtcdKV, EtcdKV]]:
    prefix = _job()
    a, b = etcd_client(shared_etcd, prefix), etcd_client(shared_etcd, prefix, first=1)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_campaign_one_of_two_contenders_wins(etcd_pair: tuple[EtcdKV, EtcdKV]) -> None:
    a, b = etcd_pair
    start = threading.Barrier(2)

    def run(kv: EtcdKV, me: bytes) -> bytes:
        start.wait(10)
        return kv.campaign("coordinator", me, ttl_s=5)

    winner, other = together(lambda: run(a, b"a"), lambda: run(b, b"b"))
    assert other == winner in (b"a", b"b")  # the loser reads the winner's value
    won, lost = (a, b) if winner == b"a" else (b, a)
    assert won.refresh() is True
    assert lost.refresh() is False  # the loser holds no lease (it gave back what it got)
    assert lost.set_held("coordinator", b"usurper") is False
    assert won.set_held("coordinator", winner + b"+round 2") is True
    assert lost.get("coordinator") == winner + b"+round 2"
    assert won.lease_ttl_s == 5


@pytest.mark.slow
def test_a_winner_that_stops_refreshing_loses_the_key_after_its_ttl(
        etcd_pair: tuple[EtcdKV, EtcdKV]) -> None:
    a, b = etcd_pair
    assert a.campaign("coordinator", b"a", ttl_s=1.2) == b"a"
    assert a.lease_ttl_s == 2  # whole seconds, at least etcd's minimum (2 s by default)
    assert a.refresh()
    t_last = time.monotonic()
    assert b.campaign("coordinator", b"b", ttl_s=2) == b"a"
    from launch_helpers import wait_for

    wait_for(lambda: b.get("coordinator") is None, 2 + 10, "the lease to expire")
    gone_after = time.monotonic() - t_last
    print(f"\nlease of 2 s not refreshed: key gone {gone_after:.2f} s after the last refresh")
    assert gone_after >= 2 - 0.5  # not before its TTL
    assert b.campaign("coordinator", b"b", ttl_s=2) == b"b"
    assert a.refresh() is False  # the old winner learns it lost
    assert a.set_held("coordinator", b"a again") is False
    assert b.get("coordinator") == b"b"


@pytest.mark.slow
def test_resign_frees_the_key_at_once(etcd_pair: tuple[EtcdKV, EtcdKV]) -> None:
    a, b = etcd_pair
    assert a.campaign("coordinator", b"a", ttl_s=30) == b"a"
    a.resign()
    assert b.get("coordinator") is None
    assert b.campaign("coordinator", b"b", ttl_s=30) == b"b"
    assert a.refresh() is False


@pytest.mark.slow
def test_set_held_keeps_the_key_on_the_lease_and_a_plain_set_does_not(
        etcd_pair: tuple[EtcdKV, EtcdKV]) -> None:
    a, b = etcd_pair
    assert a.campaign("held", b"1", ttl_s=30) == b"1"
    assert a.set_held("held", b"2") is True
    assert a.campaign("plain", b"1", ttl_s=30) == b"1"  # a second key on the same lease
    a.set("plain", b"2")  # a plain put takes the key off the lease
    a.resign()
    assert b.multi_get(["held", "plain"]) == [None, b"2"]


@pytest.mark.slow
def test_add_refuses_a_value_that_is_no_counter(etcd_pair: tuple[EtcdKV, EtcdKV]) -> None:
    a, _ = etcd_pair
    a.set("n", b"twelve")
    with pytest.raises(NotACounter, match="'n' holds b'twelve'"):
        a.add("n", 1)


@pytest.mark.slow
def test_a_put_between_the_read_and_the_watch_is_not_missed(
        etcd_pair: tuple[EtcdKV, EtcdKV]) -> None:
    """wait's read, then its watch from that read's revision + 1: a put in between wakes it."""
    a, b = etcd_pair
    key = a._key("between")
    kv, revision = a._get_kv(key)
    assert kv is None
    b.set("between", b"in between")
    t0 = time.monotonic()
    assert a._watch(key, revision + 1, time.monotonic() + 30) == b"in between"
    assert time.monotonic() - t0 < 5


def _ordered(cluster: EtcdCluster, first: int) -> str:
    ports = cluster.client_ports[first:] + cluster.client_ports[:first]
    return ",".join(f"127.0.0.1:{p}" for p in ports)


def _timed(what: str, fn: Callable[..., object], bound: float, log: list,
           *args: object) -> object:
    """``fn(*args)``, asserted to return within ``bound`` seconds; its time goes to ``log``."""
    t0 = time.monotonic()
    value = fn(*args)
    took = time.monotonic() - t0
    log.append(f"{what} {took:.2f} s")
    assert took < bound, f"{what} took {took:.2f} s"
    return value


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_leader_killed_mid_use_costs_one_election(etcd3_cluster: EtcdCluster) -> None:
    """Clients that ask the leader first (refused at once) and a follower first (held until
    the election ends) go on through the leader's SIGKILL, each call within its request
    timeout; the coordinator's lease survives unrefreshed past its TTL (etcd extends leases
    when a new leader takes over); a wait open on the dead leader still wakes."""
    cluster, timeout, ttl = etcd3_cluster, 5.0, 3
    leader = cluster.wait_leader()
    follower = (leader + 1) % 3
    prefix = _job()
    on_leader = EtcdKV.from_endpoint(_ordered(cluster, leader), prefix, timeout, {})
    on_follower = EtcdKV.from_endpoint(_ordered(cluster, follower), prefix, timeout, {})
    waiter = EtcdKV.from_endpoint(_ordered(cluster, leader), prefix, timeout, {})
    coordinator = EtcdKV.from_endpoint(_ordered(cluster, follower), prefix, timeout, {})
    assert coordinator.campaign("coordinator", b"c", ttl_s=ttl) == b"c"
    log: list[str] = []
    bound = timeout + 1.0  # a request's timeout, and one member's share, at most
    with ThreadPoolExecutor(3) as pool:
        waiting = pool.submit(timed_end(lambda: waiter.wait("after-election", 60)))
        time.sleep(0.3)  # the waiter's watch is open on the leader
        assert coordinator.refresh()
        t_kill = time.monotonic()
        cluster.kill(leader)
        # The first call of each client at once: each meets the election in its own way.
        firsts = [pool.submit(_timed, f"get ({name} first)", kv.get, bound, log, "x")
                  for name, kv in (("leader", on_leader), ("follower", on_follower))]
        assert [f.result(60) for f in firsts] == [None, None]
        _timed("set", on_follower.set, bound, log, "x", b"1")
        assert _timed("create", on_leader.create, bound, log, "y", b"1") == b"1"
        assert _timed("add", on_follower.add, bound, log, "n", 1) == 1
        assert _timed("campaign", on_leader.campaign, bound, log, "coordinator", b"l",
                      ttl) == b"c"
        _timed("set (the waited key)", on_follower.set, bound, log, "after-election", b"w")
        value, t_woken = waiting.result(60)
    assert value == b"w"
    log.append(f"wait woken {t_woken - t_kill:.2f} s after the kill")
    # Unrefreshed since before the kill: past its TTL only a new leader's extension keeps it.
    time.sleep(max(0.0, t_kill + ttl + 0.5 - time.monotonic()))
    assert on_follower.get("coordinator") == b"c", "the lease did not survive the election"
    assert _timed("refresh", coordinator.refresh, bound, log) is True
    assert coordinator.set_held("coordinator", b"c2") is True
    print("\nleader SIGKILLed: " + "; ".join(log))
    assert not cluster.alive(leader)
    for kv in (on_leader, on_follower, waiter, coordinator):
        kv.close()


def _every_call(kv: EtcdKV) -> dict[str, Callable[[], object]]:
    return {"get": lambda: kv.get("k"), "multi_get": lambda: kv.multi_get(["k", "j"]),
            "set": lambda: kv.set("k", b"v"), "create": lambda: kv.create("c", b"v"),
            "add": lambda: kv.add("n", 1), "wait": lambda: kv.wait("w", 60),
            "delete": lambda: kv.delete("k"), "refresh": kv.refresh,
            "set_held": lambda: kv.set_held("lead", b"v"),
            "campaign": lambda: kv.campaign("lead2", b"v", 5), "resign": kv.resign}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_the_whole_cluster_gone_every_call_raises_store_unreachable(
        etcd3_cluster: EtcdCluster, how: str) -> None:
    """Killed: every connection refused; frozen (SIGSTOP): connections the kernel accepts
    and nobody answers. Either way each call raises StoreUnreachable within its request
    timeout (and one member's share): none hangs, none returns."""
    timeout = 1.0
    kv = EtcdKV.from_endpoint(etcd3_cluster.endpoints, _job(), timeout, {})
    assert kv.campaign("lead", b"me", 5) == b"me"  # a lease held, and pooled connections
    if how == "killed":
        etcd3_cluster.kill_all()
    else:
        etcd3_cluster.freeze_all()
    took = {}
    for name, call in _every_call(kv).items():
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachable, match="no etcd member answered"):
            call()
        took[name] = round(time.monotonic() - t0, 2)
    print(f"\ncluster {how}: StoreUnreachable after (s) {took}")
    assert max(took.values()) < timeout + kv.attempt_s + 2.0, took  # generous: a busy machine
    kv.close()


# -- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize("conf, names", [
    ({"protocol": "ftp"}, "--rdzv-conf protocol"),
    ({"ssl_cert": "/nonexistent/cert.pem", "protocol": "https"}, "--rdzv-conf ssl_cert"),
    ({"ca_cert": "/nonexistent/ca.pem", "protocol": "https"}, "--rdzv-conf ca_cert"),
    ({"ca_cert": "", "protocol": "https"}, "--rdzv-conf ca_cert"),
    ({"ssl_cert": "CERT"}, "--rdzv-conf ssl_cert: only with protocol=https"),
    ({"ssl_cert_key": "CERT", "protocol": "https"}, "--rdzv-conf ssl_cert_key"),
])
def test_a_bad_rdzv_conf_value_names_its_key(conf: dict, names: str, tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not checked here: requests reads it at the first request")
    conf = {k: str(cert) if v == "CERT" else v for k, v in conf.items()}
    with pytest.raises(ConfigError, match=names):
        EtcdKV.from_endpoint("127.0.0.1:2379", "/p/", 2.0, conf)


def test_options_are_popped_and_the_endpoint_checked(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for f in (cert, key, ca):
        f.write_text("x")
    extra = {"protocol": "HTTPS", "ssl_cert": str(cert), "ssl_cert_key": str(key),
             "ca_cert": str(ca), "keep_alive_interval": "1"}
    kv = EtcdKV.from_endpoint("h1,h2:2380,[::1]:2381", "/p/", 2.0, extra)
    assert extra == {"keep_alive_interval": "1"}  # what is not ours stays for the others
    assert kv.members == [("h1", 2379), ("h2", 2380), ("::1", 2381)]
    assert (kv.tls.protocol, kv.tls.cert, kv.tls.cert_key, kv.tls.ca_cert) == \
        ("https", str(cert), str(key), str(ca))
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        EtcdKV.from_endpoint("h1:notaport", "/p/", 2.0, {})
    with pytest.raises(ValueError, match="empty prefix"):
        EtcdKV.from_endpoint("h1", "", 2.0, {})


def test_a_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "etcd3gw", None)  # import etcd3gw now fails
    with pytest.raises(RendezvousError, match=r"pip install 'ft-launcher\[etcd\]'"):
        EtcdKV.from_endpoint("127.0.0.1:2379", "/p/", 2.0, {})


# -- hostile answers, from a real socket -------------------------------------------------------


class _Hostile(BaseHTTPRequestHandler):
    """Answers every POST with the server's scripted (status, body, content type)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body, ctype = self.server.answer(self.path)  # type: ignore[attr-defined]
        if status is None:  # never answer (a frozen member): hold until the client leaves
            self.server.hold.wait(30)  # type: ignore[attr-defined]
            return
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hostile() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    server.hold = threading.Event()  # type: ignore[attr-defined]
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.hold.set()  # type: ignore[attr-defined]
        server.shutdown()
        server.server_close()
        t.join(10)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kv_json(key: bytes, value: str, **extra: object) -> dict:
    return {"key": _b64(key), "value": value, "mod_revision": "3", **extra}


P = b"/p/"
HOSTILE_RANGES = {
    "not JSON": (200, b"<html>hello</html>"),
    "a JSON list": (200, b"[1, 2]"),
    "deeply nested": (200, b"[" * 1500 + b"]" * 1500),  # deeper than Python's stack
    "kvs not a list": (200, json.dumps({"kvs": {"a": 1}}).encode()),
    "bad base64 value": (200, json.dumps({"kvs": [_kv_json(P + b"k", "***")]}).encode()),
    "another key": (200, json.dumps({"kvs": [_kv_json(P + b"zz", _b64(b"v"))]}).encode()),
    "two keys": (200, json.dumps({"kvs": [_kv_json(P + b"k", "")] * 2}).encode()),
    "a revision that is no number": (200, json.dumps(
        {"header": {"revision": "12abc"}}).encode()),
    "a header that is a string": (200, json.dumps({"header": "x"}).encode()),
    "a key that is a number": (200, json.dumps({"kvs": [{"key": 7}]}).encode()),
    "not etcd's 404": (404, b"404 page not found"),
    "unavailable": (503, json.dumps({"code": 14, "message": "etcdserver: no leader"}).encode()),
    "an error body that lies": (500, json.dumps({"code": "x", "message": 1}).encode()),
    "too big": (200, b'{"kvs": [], "pad": "' + b"x" * 5000 + b'"}'),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_RANGES))
def test_a_hostile_answer_raises_store_unreachable_naming_it(
        case: str, hostile: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each answer, to every read of the key: the one member failed, for the whole request
    timeout (short here), so StoreUnreachable; never a KeyError, TypeError or a hang."""
    monkeypatch.setattr(kv_etcd, "MAX_ANSWER_BYTES", 4096)
    status, body = HOSTILE_RANGES[case]
    hostile.answer = lambda path: (status, body, "application/json")  # type: ignore[attr-defined]
    kv = EtcdKV([("127.0.0.1", hostile.server_port)], "/p/", 0.2)
    calls = {"get": lambda: kv.get("k"), "wait": lambda: kv.wait("k", 5),
             "add": lambda: kv.add("k", 1), "multi_get": lambda: kv.multi_get(["k"]),
             "create": lambda: kv.create("k", b"v")}
    for name in (calls if case == "not JSON" else ["get"]):  # one path, or all of them
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachable, match="no etcd member answered"):
            calls[name]()
        assert time.monotonic() - t0 < 0.2 + 3, name
    kv.close()


def test_a_definitive_refusal_is_a_value_error_with_etcd_s_words(
        hostile: ThreadingHTTPServer) -> None:
    body = json.dumps({"code": 16, "message": "etcdserver: user name is empty"}).encode()
    hostile.answer = lambda path: (401, body, "application/json")  # type: ignore[attr-defined]
    kv = EtcdKV([("127.0.0.1", hostile.server_port)], "/p/", 1.0)
    with pytest.raises(EtcdRefused, match="user name is empty") as info:
        kv.get("k")
    assert isinstance(info.value, ValueError) and info.value.code == 16
    kv.close()


@pytest.mark.slow
def test_a_member_that_never_answers_is_left_for_the_next(
        hostile: ThreadingHTTPServer, shared_etcd: EtcdCluster) -> None:
    """The first member accepts and says nothing; the real cluster behind it answers."""
    hostile.answer = lambda path: (None, b"", "")  # type: ignore[attr-defined]
    endpoints = f"127.0.0.1:{hostile.server_port},{shared_etcd.endpoints}"
    kv = EtcdKV.from_endpoint(endpoints, _job(), 3.0, {})
    t0 = time.monotonic()
    kv.set("k", b"v")
    assert time.monotonic() - t0 < kv.attempt_s + 3
    assert kv.get("k") == b"v"  # the answering member is now asked first
    kv.close()


def _ours(threads: set[threading.Thread]) -> set[threading.Thread]:
    """Leaves out the hostile server's own threads (one per connection it served)."""
    return {t for t in threads if "process_request_thread" not in t.name}


def test_a_watch_stream_of_garbage_is_read_again_until_the_timeout(
        hostile: ThreadingHTTPServer) -> None:
    empty = json.dumps({"header": {"revision": "5"}}).encode()

    def answer(path: str) -> tuple:
        if path.endswith("/watch"):
            return 200, b'{"result": {"created": true}}\n{"result": [1]}\n', "application/json"
        return 200, empty, "application/json"

    hostile.answer = answer  # type: ignore[attr-defined]
    kv = EtcdKV([("127.0.0.1", hostile.server_port)], "/p/", 1.0)
    before = set(threading.enumerate())
    t0 = time.monotonic()
    assert kv.wait("k", 2.0) is None  # every watch broke once open: read again, to the end
    assert 2.0 <= time.monotonic() - t0 < 2.0 + 3
    assert _ours(set(threading.enumerate()) - before) == set()
    kv.close()


# The decoders alone, on anything JSON can hold: they accept, or say the member failed
# (_MemberFailed, _Malformed among them: the request goes to the next member), nothing else.
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(
                         ["kvs", "key", "value", "header", "revision", "responses",
                          "response_range", "succeeded", "result", "events", "kv", "type",
                          "canceled", "TTL", "ID", "lease", "mod_revision", "error"]),
                         inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(answer=st.dictionaries(st.sampled_from(["kvs", "header", "responses", "succeeded",
                                               "result", "error", "ID", "TTL"]), _json,
                              max_size=4))
def test_the_decoders_raise_only_member_failed(answer: dict) -> None:
    k = b"/p/k"
    decoders = [lambda a: kv_etcd._range(a, k), lambda a: kv_etcd._txn_kv(a, k),
                lambda a: kv_etcd._ranges(a, [k]), lambda a: kv_etcd._watch_message(a, k),
                kv_etcd._granted, kv_etcd._keepalive_ttl]
    for decode in decoders:
        with contextlib.suppress(kv_etcd._MemberFailed):
            decode(answer)


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.binary(max_size=40) | st.sampled_from(
    [b"\n", b'{"result":{}}\n', b"[", b'{"a":', b"\xff\n"]), max_size=8))
def test_the_watch_stream_splitter_raises_only_malformed(chunks: list[bytes]) -> None:
    with contextlib.suppress(kv_etcd._Malformed):
        for msg in kv_etcd._messages(iter(chunks)):
            assert isinstance(msg, dict)
