"""``KeyValue`` over etcd v3, plus the lease-held keys of the coordinator's election.

The client is ``etcd3gw`` (``pip install 'ft-launcher[etcd]'``): OpenStack's maintained,
pure-Python client of the JSON gateway that etcd 3.4 and later serve at ``/v3/`` on the
client port. It needs no grpc or protobuf, whose pins would clash with torch's or Megatron's.
Its ``Etcd3Client`` gives each member's URL layout over one ``requests`` session; the
requests themselves are sent here, so that an answer is read up to a bound and checked
field by field, and a watch is read in the caller's thread (etcd3gw's ``watch_once`` leaves
its reader thread running after it returns and opens its stream without a timeout).

Semantics, beyond ``nodes.kv``'s:

- Failover: each request goes to the member that answered last; a member that refuses the
  connection, does not answer within its share of the request timeout (``attempt_s``), or
  answers "unavailable" (no leader, an election in progress, too many requests) is skipped
  for the next, round after round, until the request timeout: then ``StoreUnreachable``.
  Requests carry gRPC's ``hasleader`` metadata, so a member that lost its leader says so at
  once rather than holding the request.
- Reads are linearizable (etcd's default): a member never answers from a stale copy.
- A retried write may have been applied by the try that got no answer: ``set``, ``create``,
  ``campaign`` and ``set_held`` come out the same; ``add`` may then count twice.
- Answers are untrusted: at most ``MAX_ANSWER_BYTES``, every field checked. A malformed one
  counts as that member failing; a definitive refusal (authentication, a bad request) raises
  ``EtcdRefused``; a counter that holds no decimal integer raises ``NotACounter``. Both are
  ValueErrors.
- Thread-safe: each thread gets its own ``requests`` session (a session is not), and the
  held lease is shared, so a keep-alive thread may ``refresh`` while another waits.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from ft_launcher.config import ConfigError
from ft_launcher.nodes.kv import StoreUnreachable
from ft_launcher.nodes.rendezvous import ETCD_DEFAULT_PORT, RendezvousError, parse_endpoints

log = logging.getLogger("ft_launcher")

T = TypeVar("T")

MAX_ANSWER_BYTES = 16 << 20  # one answer or one watch message; etcd's own request limit is 1.5 MiB
TXN_MAX_OPS = 128  # etcd's default --max-txn-ops: multi_get sends one txn per 128 keys
ADD_ATTEMPTS = 100  # compare-and-swap rounds an add may lose to other writers
ATTEMPT_MIN_S = 0.5  # a member gets at least this long before the next one is tried
PAUSE_S = 0.05  # between two rounds of members that all failed at once (an election)
API_PATH = "/v3/"  # etcd 3.4+: the gateway's stable path (3.3 served /v3beta/)
# gRPC metadata through the gateway: a member without a leader answers "no leader" at
# once instead of holding the request, and cancels a watch when it loses its leader.
HEADERS = {"Grpc-Metadata-hasleader": "true", "Content-Type": "application/json"}
# gRPC codes that say "this member cannot answer now", not "no": Canceled, Unknown (a
# dropped raft proposal), DeadlineExceeded, ResourceExhausted, Aborted, Internal, Unavailable.
RETRY_CODES = frozenset({1, 2, 4, 8, 10, 13, 14})
NOT_FOUND = 5  # gRPC NotFound: "requested lease not found"
_INT64 = re.compile(r"-?[0-9]{1,19}")
_COUNTER = re.compile(rb"-?[0-9]{1,19}")


class EtcdRefused(ValueError):
    """A member answered and refused the request (authentication, permission, a request
    etcd calls invalid): trying another member would not change the answer."""

    def __init__(self, path: str, code: int, message: str) -> None:
        super().__init__(f"etcd refused {path}: {message} (gRPC code {code})")
        self.code = code


class NotACounter(ValueError):
    """``add`` on a key whose value is not a decimal integer."""


class _MemberFailed(Exception):
    """This member did not answer usably; the request goes to the next one. ``refused``: it
    refused the connection (no etcd listens there)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class _Malformed(_MemberFailed):
    """The member's answer is not what etcd sends."""


class _WatchLost(Exception):
    """An open watch broke: read the key again, then watch anew."""


class _Kv(NamedTuple):
    value: bytes
    mod_revision: int
    lease: int


@dataclass
class _Conn:
    """One thread's HTTP state: a session and one etcd3gw client per member."""

    session: Any
    clients: list[Any]
    first: int = 0  # the member that answered last: asked first next time

    def order(self) -> Iterator[int]:
        n = len(self.clients)
        return ((self.first + i) % n for i in range(n))


@dataclass
class EtcdTls:
    """``--rdzv-conf``'s protocol and TLS files (paths), as ``tls_from_conf`` read them."""

    protocol: str = "http"
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None


def _as_is(answer: dict[str, Any]) -> Any:
    return answer


def _etcd3gw() -> Any:
    try:
        import etcd3gw
    except ImportError:
        raise RendezvousError("--rdzv-backend etcd needs the etcd3gw client: "
                              "pip install 'ft-launcher[etcd]'") from None
    return etcd3gw


class EtcdKV:
    """``KeyValue`` over an etcd v3 cluster, every key under ``prefix``; plus ``delete``,
    and ``campaign``/``refresh``/``resign``/``set_held`` for a key held by a lease.

    ``members`` is every member's (host, port); ``request_timeout_s`` bounds each call (a
    ``wait`` by its own timeout, each of its requests by this one), and each member gets
    ``attempt_s`` of it (a third, at least 0.5 s) before the next is tried. A leader's loss
    holds requests for its election (1 to 2.5 s measured on loopback): give 5 s or more.
    Nothing is sent before the first call. See the module docstring for failover, retries
    and threads."""

    def __init__(self, members: Sequence[tuple[str, int]], prefix: str,
                 request_timeout_s: float, tls: EtcdTls | None = None) -> None:
        if not members:
            raise ValueError("EtcdKV: no member given")
        if not prefix:
            raise ValueError("EtcdKV: an empty prefix would share keys with every job")
        if not (math.isfinite(request_timeout_s) and request_timeout_s > 0):
            raise ValueError(f"EtcdKV: request_timeout_s must be > 0, got {request_timeout_s}")
        self.members = [(str(h), int(p)) for h, p in members]
        self.prefix = prefix
        self.request_timeout_s = float(request_timeout_s)
        self.attempt_s = max(ATTEMPT_MIN_S, self.request_timeout_s / 3)
        self.tls = tls or EtcdTls()
        self._etcd3gw = _etcd3gw()
        self._local = threading.local()
        self._lock = threading.Lock()  # guards the lease, the sessions list and the counters
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()  # a thread's goes with it
        self._closed = False
        self._lease: int | None = None  # the lease our campaign keys are attached to
        self.lease_ttl_s: int | None = None  # its TTL as etcd granted it
        self.requests = 0  # requests sent, for the benchmark's traffic figures
        self.bytes = 0  # request and answer bodies, in bytes

    @classmethod
    def from_endpoint(cls, endpoint: str, prefix: str, request_timeout_s: float,
                      extra: dict[str, str]) -> EtcdKV:
        """From ``--rdzv-endpoint host:port[,host:port...]`` (port 2379 by default) and
        ``--rdzv-conf``'s ``protocol``, ``ssl_cert``, ``ssl_cert_key`` and ``ca_cert``, which
        are popped from ``extra``. Raises ConfigError naming the option, RendezvousError
        when etcd3gw is not installed."""
        members = parse_endpoints(endpoint, ETCD_DEFAULT_PORT)
        return cls(members, prefix, request_timeout_s, tls_from_conf(extra))

    # -- KeyValue ----------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        kv, _ = self._get_kv(self._key(key))
        return kv.value if kv else None

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Every key's value, None for a missing one: one read-only txn per 128 keys."""
        out: list[bytes | None] = []
        names = [self._key(k) for k in keys]
        for i in range(0, len(names), TXN_MAX_OPS):
            chunk = names[i:i + TXN_MAX_OPS]
            txn = {"success": [{"request_range": {"key": _b64(k)}} for k in chunk]}
            out += self._request("kv/txn", txn, lambda a, c=chunk: _ranges(a, c))
        return out

    def set(self, key: str, value: bytes) -> None:
        """Put ``value``. A plain put detaches the key from any lease: a key won by
        ``campaign`` is updated with ``set_held``."""
        self._request("kv/put", {"key": _b64(self._key(key)), "value": _b64(value)})

    def create(self, key: str, value: bytes) -> bytes:
        """Write ``value`` unless the key exists (one txn: create_revision == 0, else read
        it); the value the key holds now: ours when we were first."""
        k = self._key(key)
        txn = _create_txn(k, {"key": _b64(k), "value": _b64(value)})
        kv = self._request("kv/txn", txn, lambda a: _created(a, k))
        return value if kv is None else kv.value

    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to a counter kept as decimal text (a missing key counts as 0) by
        compare-and-swap on its mod_revision; the new value. For counters that few nodes
        write at once: each lost round costs a request, and after ``ADD_ATTEMPTS`` lost
        rounds it raises StoreUnreachable. A try retried after it got no answer may have
        counted already (see the module docstring): use it where a skipped number does no
        harm, never for an exact census."""
        k = self._key(key)
        kv, _ = self._get_kv(k)
        for _ in range(ADD_ATTEMPTS):
            new = _counter(key, kv) + int(delta)
            txn = {"compare": [{"key": _b64(k), "result": "EQUAL", "target": "MOD",
                                "mod_revision": str(kv.mod_revision if kv else 0)}],
                   "success": [{"request_put": {"key": _b64(k), "value": _b64(b"%d" % new)}}],
                   "failure": [{"request_range": {"key": _b64(k)}}]}
            succeeded, kv = self._request("kv/txn", txn, lambda a: _txn_kv(a, k))
            if succeeded:
                return new
        raise StoreUnreachable(f"etcd: add to {key!r} lost {ADD_ATTEMPTS} rounds to other "
                               f"writers")

    def wait(self, key: str, timeout: float) -> bytes | None:
        """Block until ``key`` exists, at most ``timeout`` seconds; its value, or None at
        the timeout. A read, then a watch from the read's revision + 1 (a put in between is
        not missed), read in this thread and closed before returning. A member that freezes
        while it holds the watch delays the wake-up to the timeout: wait in slices of the
        time the caller can afford to learn late."""
        k = self._key(key)
        deadline = time.monotonic() + max(float(timeout), 0.0)
        while True:
            kv, revision = self._get_kv(k)
            if kv is not None:
                return kv.value
            if time.monotonic() >= deadline:
                return None
            found = self._watch(k, revision + 1, deadline)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                return None
            time.sleep(PAUSE_S)  # the watch was cancelled or broke: read again, then watch

    def close(self) -> None:
        """Close every thread's connections. A held lease is not revoked (``resign`` does
        that): it lapses after its TTL."""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions)
        for session in sessions:
            session.close()

    # -- beyond KeyValue ---------------------------------------------------------------

    def delete(self, key: str) -> None:
        self._request("kv/deleterange", {"key": _b64(self._key(key))})

    def campaign(self, key: str, value: bytes, ttl_s: float) -> bytes:
        """Create ``key`` attached to our lease if it is absent (one txn: create_revision
        == 0); the value it holds now: ours when we hold it. The lease is granted here
        (``ttl_s`` rounded up to whole seconds; etcd raises anything under its minimum,
        about 2 s, and ``lease_ttl_s`` says what it granted) unless we hold one already,
        which the key then joins. A lost campaign revokes a lease it granted. Each
        contender gives a value of its own (its address and a nonce): the value returned
        tells it whether it won."""
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"campaign: ttl_s must be > 0, got {ttl_s}")
        k = self._key(key)
        granted = False
        with self._lock:
            lease = self._lease
        if lease is None:
            lease, granted = self._grant(ttl_s), True
        put = {"key": _b64(k), "value": _b64(value), "lease": str(lease)}
        kv = self._request("kv/txn", _create_txn(k, put), lambda a: _created(a, k))
        if kv is None:
            return value
        if kv.lease != lease and granted:  # lost (on our lease already: a retried txn won)
            self._drop_lease(lease)
        return kv.value

    def refresh(self, timeout_s: float | None = None) -> bool:
        """Keep our lease alive (one keep-alive request, within ``timeout_s`` when given,
        else the request timeout): False when it is gone (expired or revoked: the keys it
        held are gone) or when we hold none."""
        with self._lock:
            lease = self._lease
        if lease is None:
            return False
        ttl = self._request("lease/keepalive", {"ID": str(lease)}, _keepalive_ttl, timeout_s)
        if ttl > 0:
            return True
        with self._lock:
            if self._lease == lease:
                self._lease = None
        return False

    def resign(self) -> None:
        """Revoke our lease: every key it holds goes at once."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            self._revoke(lease)

    def set_held(self, key: str, value: bytes) -> bool:
        """Put ``value`` into a key we hold by ``campaign``, kept on our lease, only while
        the key is still on our lease (one txn): False when it is not (lost, or never won)."""
        with self._lock:
            lease = self._lease
        if lease is None:
            return False
        k = self._key(key)
        txn = {"compare": [{"key": _b64(k), "result": "EQUAL", "target": "LEASE",
                            "lease": str(lease)}],
               "success": [{"request_put": {"key": _b64(k), "value": _b64(value),
                                            "lease": str(lease)}}]}
        succeeded, _ = self._request("kv/txn", txn, lambda a: _txn_kv(a, k))
        return succeeded

    # -- leases ------------------------------------------------------------------------

    def _grant(self, ttl_s: float) -> int:
        ttl = max(1, math.ceil(ttl_s))
        lease, granted_ttl = self._request("lease/grant", {"TTL": str(ttl), "ID": "0"},
                                           _granted)
        with self._lock:
            self._lease, self.lease_ttl_s = lease, granted_ttl
        return lease

    def _revoke(self, lease: int) -> None:
        try:
            self._request("kv/lease/revoke", {"ID": str(lease)})
        except EtcdRefused as exc:
            if exc.code != NOT_FOUND:  # not found: it expired already, which is as good
                raise

    def _drop_lease(self, lease: int) -> None:
        """Give back a lease we granted for a campaign we lost; it lapses by its TTL if
        etcd cannot be reached now."""
        with self._lock:
            if self._lease == lease:
                self._lease = None
        try:
            self._revoke(lease)
        except StoreUnreachable as exc:
            log.debug("etcd: lease %x not revoked, it lapses by its TTL: %s", lease, exc)

    # -- requests ----------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _get_kv(self, k: bytes) -> tuple[_Kv | None, int]:
        """The key (None when absent) and the store's revision of that read."""
        return self._request("kv/range", {"key": _b64(k)}, lambda a: _range(a, k))

    def _conn(self) -> _Conn:
        if self._closed:
            raise RuntimeError("EtcdKV: used after close()")
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        import requests

        session = requests.Session()
        # Members are reached directly: a proxy set for the web (HTTPS_PROXY) is not theirs.
        session.trust_env = False
        session.verify = self.tls.ca_cert or True
        if self.tls.cert:
            session.cert = (self.tls.cert, self.tls.cert_key) if self.tls.cert_key \
                else self.tls.cert
        clients = [self._client(h, p, session) for h, p in self.members]
        with self._lock:
            if self._closed:
                session.close()
                raise RuntimeError("EtcdKV: used after close()")
            self._sessions.add(session)
        self._local.conn = conn = _Conn(session, clients)
        return conn

    def _client(self, host: str, port: int, session: Any) -> Any:
        """etcd3gw's client of one member, over this thread's session (assigned, not passed:
        etcd3gw takes a session argument only from 2.6 on)."""
        client = self._etcd3gw.Etcd3Client(host=host, port=port, protocol=self.tls.protocol,
                                           api_path=API_PATH)
        client.session.close()
        client.session = session
        return client

    def _request(self, path: str, payload: dict[str, Any],
                 parse: Callable[[dict[str, Any]], T] = _as_is,  # type: ignore[assignment]
                 timeout_s: float | None = None) -> T:
        """POST ``payload`` to the members in turn until one answers and ``parse`` accepts
        the answer, within ``timeout_s`` (the request timeout by default); StoreUnreachable
        when none did."""
        conn = self._conn()
        started = time.monotonic()
        deadline = started + (self.request_timeout_s if timeout_s is None else timeout_s)
        failures: dict[int, str] = {}
        refused: set[int] = set()
        while True:
            for i in conn.order():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    answer = parse(self._post(conn.clients[i], path, payload,
                                              min(left, self.attempt_s)))
                except _MemberFailed as exc:
                    failures[i] = str(exc)
                    (refused.add if exc.refused else refused.discard)(i)
                    log.debug("etcd: %s:%d failed %s: %s", *self.members[i], path, exc)
                    continue
                conn.first = i
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._unreachable(path, failures, deadline - started,
                                        refused=len(refused) == len(self.members))
            time.sleep(min(PAUSE_S, left))

    def _post(self, client: Any, path: str, payload: dict[str, Any],
              timeout_s: float) -> dict[str, Any]:
        """One request to one member: its answer as a JSON object, or _MemberFailed, or
        EtcdRefused."""
        import requests

        body = json.dumps(payload).encode()
        try:
            resp = client.session.post(client.get_url(path), data=body, headers=HEADERS,
                                       timeout=(timeout_s, timeout_s), stream=True)
            try:
                data = _read_bounded(resp, time.monotonic() + timeout_s)
            finally:
                resp.close()
        except requests.RequestException as exc:
            raise _MemberFailed(_describe(exc), _refused(exc)) from None
        with self._lock:
            self.requests += 1
            self.bytes += len(body) + len(data)
        if resp.status_code == 200:
            return _json_object(data, path)
        raise _error_answer(path, resp.status_code, data)

    def _unreachable(self, path: str, failures: dict[int, str],
                     within_s: float | None = None, refused: bool = False) -> StoreUnreachable:
        said = "; ".join(f"{h}:{p}: {failures.get(i, 'not tried')}"
                         for i, (h, p) in enumerate(self.members))
        return StoreUnreachable(f"no etcd member answered {path} within "
                                f"{within_s or self.request_timeout_s:.3g} s ({said})", refused)

    # -- watch -------------------------------------------------------------------------

    def _watch(self, k: bytes, start_revision: int, deadline: float) -> bytes | None:
        """The value of the first put of ``k`` from ``start_revision`` on, or None at the
        deadline, or when the watch was cancelled or broke once open (the caller reads
        again). Opening it fails over like a request: StoreUnreachable when no member
        opens it within the request timeout."""
        conn = self._conn()
        create = {"create_request": {"key": _b64(k), "start_revision": str(start_revision),
                                     "filters": ["NODELETE"]}}
        open_by = time.monotonic() + self.request_timeout_s
        failures: dict[int, str] = {}
        while True:
            for i in conn.order():
                if min(open_by, deadline) <= time.monotonic():
                    break
                try:
                    return self._watch_member(conn.clients[i], create, k, deadline)
                except _MemberFailed as exc:
                    failures[i] = str(exc)
                except _WatchLost as exc:
                    log.debug("etcd: watch on %s:%d lost: %s", *self.members[i], exc)
                    conn.first = (i + 1) % len(self.members)  # read and watch elsewhere
                    return None
            now = time.monotonic()
            if now >= deadline:
                return None
            if now >= open_by:
                raise self._unreachable("watch", failures)
            time.sleep(PAUSE_S)

    def _watch_member(self, client: Any, create: dict[str, Any], k: bytes,
                      deadline: float) -> bytes | None:
        import requests

        open_s = min(self.attempt_s, max(deadline - time.monotonic(), 0.001))
        try:
            resp = client.session.post(client.get_url("watch"), json=create, headers=HEADERS,
                                       timeout=(open_s, open_s), stream=True)
        except requests.RequestException as exc:
            raise _MemberFailed(_describe(exc)) from None
        try:
            if resp.status_code != 200:
                data = _read_bounded(resp, time.monotonic() + open_s)
                raise _error_answer("watch", resp.status_code, data)
            with self._lock:
                self.requests += 1
            return _read_watch(resp, k, deadline, time.monotonic() + open_s)
        except requests.RequestException as exc:
            raise _MemberFailed(_describe(exc)) from None
        finally:
            resp.close()  # ends the stream: the member cancels the watch


def tls_from_conf(extra: dict[str, str]) -> EtcdTls:
    """Pop ``protocol``, ``ssl_cert``, ``ssl_cert_key`` and ``ca_cert`` from ``--rdzv-conf``'s
    leftover keys; ConfigError naming the key for a bad value."""
    protocol = extra.pop("protocol", "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol: expected http or https, got {protocol!r}")
    tls = EtcdTls(protocol)
    for name, attr in (("ssl_cert", "cert"), ("ssl_cert_key", "cert_key"),
                       ("ca_cert", "ca_cert")):
        if name not in extra:
            continue
        path = extra.pop(name).strip()
        if protocol != "https":
            raise ConfigError(f"--rdzv-conf {name}: only with protocol=https")
        if not path:
            raise ConfigError(f"--rdzv-conf {name}: expected a file's path, got nothing")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"--rdzv-conf {name}: cannot read {path!r}: "
                              f"{exc.strerror or exc}") from None
        setattr(tls, attr, path)
    if tls.cert_key and not tls.cert:
        raise ConfigError("--rdzv-conf ssl_cert_key: given without ssl_cert")
    return tls


# -- answers: untrusted input, every field checked -----------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _refused(exc: BaseException) -> bool:
    """Whether a request failed because the member refused the connection: requests wraps
    the socket's ConnectionRefusedError a few causes deep."""
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo and len(seen) < 20:
        e = todo.pop()
        if not isinstance(e, BaseException) or e in seen:
            continue
        if isinstance(e, ConnectionRefusedError):
            return True
        seen.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args]
    return False


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _read_bounded(resp: Any, deadline: float) -> bytes:
    """The answer's body, at most MAX_ANSWER_BYTES, all of it by ``deadline``."""
    data = bytearray()
    for chunk in resp.iter_content(64 << 10):
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            raise _Malformed(f"an answer over {MAX_ANSWER_BYTES} bytes")
        if time.monotonic() > deadline:
            raise _MemberFailed("the answer came too slowly")
    return bytes(data)


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the stack
        raise _Malformed(f"{what}: an answer that is not JSON: {data[:80]!r}") from None
    return _obj(value, what)


def _error_answer(path: str, status: int, data: bytes) -> Exception:
    """What a non-200 answer means: EtcdRefused for etcd's definitive "no", else this
    member failed (unavailable, timed out, or not etcd's gateway at all)."""
    try:
        err = _json_object(data, path)
        code, message = err.get("code"), err.get("message", err.get("error"))
    except _Malformed:
        code = message = None
    if not isinstance(code, int) or isinstance(code, bool) or not isinstance(message, str):
        return _Malformed(f"HTTP {status} without etcd's error body: {data[:80]!r}"
                          + (" (etcd 3.4 or later serves /v3/)" if status == 404 else ""))
    if status in (408, 429) or status >= 500 or code in RETRY_CODES:
        return _MemberFailed(f"HTTP {status}: {message[:200]!r}")
    return EtcdRefused(path, code, message[:500])


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Malformed(f"{what}: expected an object, got {type(value).__name__}")
    return value


def _list(parent: dict[str, Any], name: str) -> list[dict[str, Any]]:
    value = parent.get(name, [])
    if not isinstance(value, list) or len(value) > 100_000:
        raise _Malformed(f"{name}: expected a list")
    return [_obj(item, name) for item in value]


def _int(parent: dict[str, Any], name: str) -> int:
    """An int64 field: the gateway writes it as a decimal string; absent means 0."""
    value = parent.get(name, 0)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INT64.fullmatch(value):
        return int(value)
    raise _Malformed(f"{name}: expected an integer, got {str(value)[:40]!r}")


def _bytes(parent: dict[str, Any], name: str) -> bytes:
    value = parent.get(name, "")
    if not isinstance(value, str):
        raise _Malformed(f"{name}: expected base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _Malformed(f"{name}: not base64: {value[:40]!r}") from None


def _bool(parent: dict[str, Any], name: str) -> bool:
    value = parent.get(name, False)
    if not isinstance(value, bool):
        raise _Malformed(f"{name}: expected true or false")
    return value


def _kv(item: dict[str, Any], k: bytes) -> _Kv:
    if _bytes(item, "key") != k:
        raise _Malformed(f"an answer about another key than {k!r}")
    return _Kv(_bytes(item, "value"), _int(item, "mod_revision"), _int(item, "lease"))


def _one_kv(rng: dict[str, Any], k: bytes) -> _Kv | None:
    kvs = _list(rng, "kvs")
    if len(kvs) > 1:
        raise _Malformed(f"{len(kvs)} keys for the one key {k!r}")
    return _kv(kvs[0], k) if kvs else None


def _range(answer: dict[str, Any], k: bytes) -> tuple[_Kv | None, int]:
    return _one_kv(answer, k), _int(_obj(answer.get("header", {}), "header"), "revision")


def _ranges(answer: dict[str, Any], keys: list[bytes]) -> list[bytes | None]:
    responses = _list(answer, "responses")
    if len(responses) != len(keys):
        raise _Malformed(f"{len(responses)} answers to {len(keys)} reads")
    out = []
    for resp, k in zip(responses, keys, strict=True):
        kv = _one_kv(_obj(resp.get("response_range"), "response_range"), k)
        out.append(kv.value if kv else None)
    return out


def _create_txn(k: bytes, put: dict[str, str]) -> dict[str, Any]:
    return {"compare": [{"key": _b64(k), "result": "EQUAL", "target": "CREATE",
                         "create_revision": "0"}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(k)}}]}


def _txn_kv(answer: dict[str, Any], k: bytes) -> tuple[bool, _Kv | None]:
    """(succeeded, the key as the failure branch's read found it)."""
    succeeded = _bool(answer, "succeeded")
    if succeeded:
        return True, None
    for resp in _list(answer, "responses"):
        if "response_range" in resp:
            return False, _one_kv(_obj(resp["response_range"], "response_range"), k)
    return False, None


def _created(answer: dict[str, Any], k: bytes) -> _Kv | None:
    """A create txn's outcome: None when ours went in, else the key that was there first
    (which the failure branch must have read: it failed because the key exists)."""
    succeeded, kv = _txn_kv(answer, k)
    if not succeeded and kv is None:
        raise _Malformed("a create that failed without the key that made it fail")
    return kv


def _granted(answer: dict[str, Any]) -> tuple[int, int]:
    if answer.get("error"):
        raise _Malformed(f"lease grant: {str(answer['error'])[:200]!r}")
    lease, ttl = _int(answer, "ID"), _int(answer, "TTL")
    if lease <= 0 or ttl <= 0:
        raise _Malformed(f"lease grant: ID {lease}, TTL {ttl}")
    return lease, ttl


def _keepalive_ttl(answer: dict[str, Any]) -> int:
    return _int(_obj(answer.get("result"), "result"), "TTL")


def _counter(key: str, kv: _Kv | None) -> int:
    if kv is None:
        return 0
    if not _COUNTER.fullmatch(kv.value):
        raise NotACounter(f"etcd: {key!r} holds {kv.value[:40]!r}, not a decimal counter")
    return int(kv.value)


def _read_watch(resp: Any, k: bytes, deadline: float, created_by: float) -> bytes | None:
    """Read a watch stream until the first put of ``k`` (its value), the deadline or a
    cancellation (None). Before each read the socket's timeout is set to the time left, so
    the read ends at the deadline. Fails with _MemberFailed before etcd said the watch was
    created (another member may open it), with _WatchLost after."""
    sock = _socket_of(resp)
    messages = _messages(resp.iter_content(None))
    created = False
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                return None
            if not created and now >= created_by:
                raise _MemberFailed("the watch was not created in time")
            if sock is not None:
                sock.settimeout(max((deadline if created else min(deadline, created_by))
                                    - now, 0.001))
            msg = _next_message(messages, deadline)
            if msg is None:
                return None
            created = True
            done, value = _watch_message(msg, k)
            if done:
                return value
    except _MemberFailed as exc:
        if created:
            raise _WatchLost(str(exc)) from None
        raise


def _next_message(messages: Iterator[dict[str, Any]], deadline: float) -> dict | None:
    """The stream's next message; None when the read ran into the deadline."""
    try:
        return next(messages)
    except StopIteration:
        raise _MemberFailed("the member ended the watch") from None
    except _MemberFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - requests' ConnectionError for a read timeout
        if time.monotonic() >= deadline - 0.01:
            return None
        raise _MemberFailed(_describe(exc)) from None


def _messages(chunks: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a watch stream, one a line, each at most MAX_ANSWER_BYTES."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        while (nl := buf.find(b"\n")) >= 0:
            line = bytes(buf[:nl])
            del buf[:nl + 1]
            if line.strip():
                yield _json_object(line, "watch")
        if len(buf) > MAX_ANSWER_BYTES:
            raise _Malformed(f"a watch message over {MAX_ANSWER_BYTES} bytes")


def _watch_message(msg: dict[str, Any], k: bytes) -> tuple[bool, bytes | None]:
    """(done, value): done with the put's value, or done with None when the watch was
    cancelled (compacted, the member lost its leader); not done otherwise."""
    if "error" in msg:
        err = _obj(msg["error"], "error")
        raise _MemberFailed(f"watch: {str(err.get('message'))[:200]!r}")
    result = _obj(msg.get("result"), "result")
    if _bool(result, "canceled"):
        return True, None
    for event in _list(result, "events"):
        if event.get("type", "PUT") != "PUT":
            continue
        kv = _obj(event.get("kv"), "kv")
        if _bytes(kv, "key") == k:
            return True, _bytes(kv, "value")
    return False, None


def _socket_of(resp: Any) -> Any:
    """The stream's socket, to bound each read by the time left; None if urllib3 hides it
    (then the read timeout set at the open, itself within the deadline, bounds the read)."""
    connection = getattr(resp.raw, "connection", None)
    return getattr(connection, "sock", None)

