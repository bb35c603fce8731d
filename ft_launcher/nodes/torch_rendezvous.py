"""torch's own dynamic rendezvous (``DynamicRendezvousHandler``), tuned for fast failure
detection: ``--rdzv-backend torch-c10d`` (a TCPStore hosted by one launcher) and
``etcd-v2`` (an etcd cluster that still serves the v2 API, through python-etcd).

Kept for comparison with the launcher's own rendezvous (``nodes.member``) and for users who
need torch's. It reaches into torch's private names (its state holder, heartbeat lock, op
executor, ``_delay``), keeps the whole job's state in one value that every node
compare-and-sets, and compares wall clocks across nodes for liveness: see
docs/several-nodes.md for what that costs. Hang verdicts stay on the node that made them.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from ft_launcher.config import ConfigError
from ft_launcher.nodes.rendezvous import (
    ETCD_DEFAULT_PORT,
    OBSERVER_ERRORS,
    EventSink,
    RendezvousClosed,
    RendezvousError,
    RendezvousLost,
    RendezvousTimings,
    RoundInfo,
    RoundView,
    Standing,
    free_port,
    parse_endpoints,
    reachable_address,
)

log = logging.getLogger("ft_launcher")

TORCH_BACKENDS = ("torch-c10d", "etcd-v2")
ETCD_RDZV_PREFIX = "/torch/elastic/rendezvous"  # torch's own key layout for etcd-v2
ETCD_STORE_PREFIX = "/torch/elastic/store"


# -- torch's dynamic rendezvous, tuned (the only place that touches its internals) ---------


def install_poll_interval(poll_s: float) -> bool:
    """Make torch's join loop poll the shared state every ``poll_s`` instead of its fixed
    1 s (``_delay(seconds=1)`` in dynamic_rendezvous; no setting exists). Process-wide,
    which is fine: a launcher runs one rendezvous. False when torch no longer has the hook
    (then rounds still form, only slower)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    current = getattr(dr, "_delay", None)
    if current is None:
        log.warning("rendezvous: torch's poll delay not found; polling every 1 s")
        return False
    original = getattr(current, "ft_original", current)

    def delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # the random skew before a round: at most one poll
            seconds = (min(seconds[0], poll_s), min(seconds[1], poll_s))
        original(poll_s if seconds == 1 else seconds)

    delay.ft_original = original  # type: ignore[attr-defined]
    dr._delay = delay
    install_cheap_method_names()
    return True


def install_cheap_method_names() -> None:
    """torch names each rendezvous event after its caller with ``inspect.stack()``, which
    reads the source of every frame: 5 ms a call, tens per round, a second per round on a
    loaded node. The same name comes from the frame itself."""
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = getattr(dr, "get_method_name", None)
    if original is None:
        return
    original = getattr(original, "ft_original", original)

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    get_method_name.ft_original = original  # type: ignore[attr-defined]
    dr.get_method_name = get_method_name


def _observed_holder(backend: Any, settings: Any, cache_s: float,
                     observe: Callable[[Any], None]) -> Any:
    """torch's state holder (a cached view of the shared rendezvous state) that reports
    every state it reads to ``observe``, in the thread that synced."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    class ObservedStateHolder(dr._BackendRendezvousStateHolder):
        def sync(self) -> bool | None:
            result = super().sync()
            try:
                observe(self.state)
            except OBSERVER_ERRORS:  # an observer must never break torch's state machine
                log.exception("rendezvous: state observer failed")
            return result

    return ObservedStateHolder(backend, settings, cache_duration=cache_s)


def _c10d_backend(params: Any, timings: RendezvousTimings) -> tuple[Any, Any]:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    backend, store = create_backend(params)
    # read_timeout bounded the connection; from now on a request that gets no answer (the
    # host's machine is gone) fails within the keep-alive expiry, not after a minute.
    store.set_timeout(timedelta(seconds=timings.dead_after))
    return backend, store


def _etcd_backend(endpoint: str, run_id: str, timings: RendezvousTimings,
                  extra: dict[str, str]) -> tuple[Any, Any]:
    """torch's etcd-v2 backend and store over one python-etcd client that knows every
    member, so a member's loss fails over (torch's own factory takes one host only)."""
    try:
        import etcd
    except ModuleNotFoundError:
        raise RendezvousError("--rdzv-backend etcd-v2 needs the python-etcd client: "
                              "pip install 'ft-launcher[etcd-v2]'") from None
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
        EtcdRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    hosts = parse_endpoints(endpoint, ETCD_DEFAULT_PORT)
    protocol = extra.pop("protocol", "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol: expected http or https, got {protocol!r}")
    cert = extra.pop("ssl_cert", None)
    key = extra.pop("ssl_cert_key", None)
    kwargs: dict[str, Any] = {
        "protocol": protocol,
        "read_timeout": timings.read_timeout or timings.dead_after,
        "allow_reconnect": True,
        "cert": (cert, key) if cert and key else cert,
        "ca_cert": extra.pop("ca_cert", None),
    }
    # One line per failed member request is enough; urllib3's retries say it three times.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    logging.getLogger("etcd.client").setLevel(logging.WARNING)

    class QuorumClient(etcd.Client):
        """Reads go through the raft leader: a lagging member's stale state would let two
        nodes each believe they completed a round (etcd v2 reads are local by default)."""

        def read(self, key: str, **kwargs: Any) -> Any:
            if not kwargs.get("wait"):
                kwargs.setdefault("quorum", True)
            return super().read(key, **kwargs)

    if len(hosts) == 1:
        client = QuorumClient(host=hosts[0][0], port=hosts[0][1], **kwargs)
    else:
        client = QuorumClient(host=tuple(hosts), **kwargs)
    backend = EtcdRendezvousBackend(client, run_id, key_prefix=ETCD_RDZV_PREFIX)
    store = EtcdStore(client, ETCD_STORE_PREFIX, timeout=timedelta(seconds=timings.dead_after))
    return backend, store


def _unreachable_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the rendezvous service did not answer"."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    types: list[type[BaseException]] = [RendezvousConnectionError, dist.DistNetworkError,
                                        ConnectionError, TimeoutError]
    try:
        import etcd
        import urllib3.exceptions

        types += [etcd.EtcdConnectionFailed, urllib3.exceptions.HTTPError]
    except ModuleNotFoundError:
        pass
    return tuple(types)


def gone(members: frozenset[Any], state: Any) -> tuple[str, ...]:
    """The nodes of ``members`` (a round's participants) that ``state``'s round lacks."""
    return tuple(sorted(str(n) for n in members - set(state.participants)))


def out_of_round(state: Any, node: Any, round_no: int | None, dead_after: float,
                 margin_s: float = 0.0, now: datetime | None = None) -> str | None:
    """Pure: why ``node`` no longer belongs to round ``round_no`` of torch's rendezvous
    ``state`` (closed, the round moved on, the node dropped; with ``margin_s``, its last
    keep-alive less than that from the expiry ``dead_after``), or None when it does."""
    if round_no is None:
        return None
    if state.closed:
        return "the rendezvous was closed"
    if state.round != round_no:
        return f"round {round_no} is over: the others moved on to round {state.round}"
    if node not in state.participants:
        return (f"dropped from round {round_no}: its keep-alive lapsed (none for "
                f"{dead_after:g} s)")
    last = state.last_heartbeats.get(node)
    if margin_s > 0 and last is not None:
        age = ((now or datetime.now(timezone.utc)) - last).total_seconds()
        if age > dead_after - margin_s:
            return (f"its last keep-alive is {age:.1f} s old: the others drop it at "
                    f"{dead_after:g} s")
    return None


def is_spare(state: Any, node: Any, max_nodes: int) -> bool:
    """``node`` waits as a hot spare: on the redundancy list, or on a full wait list."""
    return node in state.redundancy_list or on_full_wait_list(state, node, max_nodes)


def waiting_to_join(state: Any, max_nodes: int) -> int:
    """Nodes that wait for a place a restart would give them (not the spares)."""
    return sum(not on_full_wait_list(state, n, max_nodes) for n in state.wait_list)


def on_full_wait_list(state: Any, node: Any, max_nodes: int) -> bool:
    """``node`` is on the wait list of a complete round that has its maximum size: a spare.
    torch puts a node on the redundancy list only if it is not on the wait list already,
    and a node joins the wait list whenever it re-joins while its round is short (its peer
    has not left yet, or was lost). When that node then loses the race for a place in the
    next round, it stays on the wait list of a full round: counted as waiting, it would make
    the round's nodes restart, the same race would leave one node out again, and so on (a
    restart storm)."""
    return bool(state.complete and node in state.wait_list
                and len(state.participants) >= max_nodes)


def _closed(endpoint: str, spare: bool, dropped: bool) -> RendezvousClosed:
    """The job's rendezvous was closed by the other nodes; a dropped node ends as a spare."""
    why = ("; this node was dropped from its round and not needed again" if dropped
           else "; this spare was not needed" if spare else "")
    return RendezvousClosed(f"the rendezvous at {endpoint} was closed by the other nodes "
                            f"(the job is over){why}", was_spare=spare or dropped)


class DynamicRendezvous:
    """torch's dynamic rendezvous over c10d or etcd-v2, with fast timings, hot-spare events,
    and distinct errors for a lost service and a closed job.

    Entry points for the supervisor: ``next_round()`` (blocks; emits ``spare_waiting`` and
    ``spare_admitted`` through ``events`` while it waits as a spare), ``num_nodes_waiting()``
    (poll while workers run), ``exit_barrier()``, ``shutdown(close)``. Both blocking calls
    raise ``RendezvousLost`` when the service is gone and ``RendezvousClosed`` when the job
    is over; any other failure is a ``RendezvousError``.
    """

    MASTER_KEY = "ft_launcher/master"
    polls_peers = True  # poll_round() reads the shared state: nodes waiting, nodes lost

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        conf: dict[str, str],
        fixed_port: int | None,
        backend: str = "torch-c10d",
        events: EventSink | None = None,
        local_addr: str | None = None,
    ) -> None:
        if backend not in TORCH_BACKENDS:
            raise ConfigError(f"--rdzv-backend: expected one of {', '.join(TORCH_BACKENDS)}, "
                              f"got {backend!r}")
        if not endpoint:
            raise ConfigError(f"--rdzv-endpoint: required with --rdzv-backend {backend}")
        # The workers form their own store per cycle; the agent's shared one is not wanted.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.backend = backend
        self.endpoint = endpoint
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.fixed_port = fixed_port
        self.events = events
        self.timings, extra = RendezvousTimings.from_conf(conf)
        if backend == "etcd-v2":
            parse_endpoints(endpoint, ETCD_DEFAULT_PORT)  # a clear error before any I/O
        # A c10d store's client never reconnects: its first broken request is final. The
        # etcd client fails over between members; a leader election takes about a second.
        self._lost_grace = 0.0 if backend == "torch-c10d" else self.timings.dead_after
        self._unreachable_since: float | None = None
        self._in_round = False
        self._spare_since: float | None = None
        self._round: tuple[Any, int] | None = None  # (store, group world size)
        self._round_no: int | None = None  # the round this node joined last
        self._members: frozenset[Any] = frozenset()  # that round's participants
        self._was_dropped = False  # dropped from a round: a closed job then ends it cleanly
        self.job_store: Any = None
        # torchrun's --local-addr, else the address peers reach this node by.
        self.local_addr = local_addr or reachable_address(endpoint.split(",")[0].strip("[]"))
        install_poll_interval(self.timings.poll_interval)
        self._unreachable = _unreachable_types()
        try:
            self.handler, self._node = self._make_handler(run_id, extra)
        except (ConfigError, RendezvousError):
            raise
        except Exception as exc:  # torch and the clients raise many kinds here
            raise RendezvousError(f"--rdzv-endpoint {endpoint}: cannot reach the {backend} "
                                  f"rendezvous: {type(exc).__name__} {exc}") from None

    def _make_handler(self, run_id: str, extra: dict[str, str]) -> tuple[Any, Any]:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        t = self.timings
        if self.backend == "torch-c10d":
            params = RendezvousParameters(
                backend="c10d", endpoint=self.endpoint, run_id=run_id,
                min_nodes=self.min_nodes, max_nodes=self.max_nodes, local_addr=self.local_addr,
                **extra, read_timeout=math.ceil(t.read_timeout or 60))
            backend, store = _c10d_backend(params, t)
        else:
            backend, store = _etcd_backend(self.endpoint, run_id, t, extra)
        self.job_store = store  # the job's store, not a round's: the snapshot replica token
        settings = dr.RendezvousSettings(
            run_id, self.min_nodes, self.max_nodes,
            dr.RendezvousTimeout(join=timedelta(seconds=t.join_timeout),
                                 last_call=timedelta(seconds=t.last_call_timeout),
                                 close=timedelta(seconds=t.close_timeout),
                                 heartbeat=timedelta(seconds=t.heartbeat_timeout)),
            keep_alive_interval=timedelta(seconds=t.keep_alive_interval),
            keep_alive_max_attempt=t.keep_alive_max_attempt)
        holder = _observed_holder(backend, settings, t.poll_interval, self._observe)
        node = dr.DynamicRendezvousHandler._node_desc_generator.generate(self.local_addr)
        return dr.DynamicRendezvousHandler(node, settings, backend.name, store, holder), node

    # -- events --------------------------------------------------------------------------

    def _emit(self, name: str, **fields: Any) -> None:
        if self.events is None:
            return
        try:
            self.events(name, **fields)
        except OBSERVER_ERRORS:  # recording must never break the rendezvous
            log.exception("rendezvous: cannot record %s", name)

    def _observe(self, state: Any) -> None:
        """Called with every state read: while it waits for a round, is this node a spare?"""
        if not self._in_round or self._spare_since is not None:
            return
        if is_spare(state, self._node, self.max_nodes):
            self._spare_since = time.monotonic()
            self._emit("spare_waiting", round=state.round, participants=len(state.participants),
                       max_nodes=self.max_nodes)

    @property
    def stop_fence_s(self) -> float:
        """Set in the workers' environment (``FT_STOP_FENCE_S``): after a stop this long a
        rank asks its launcher whether its round is still current before going on."""
        return self.timings.stop_fence_s

    @property
    def round_store(self) -> Any | None:
        """The store of the current round (torch prefixes it per round), None before one."""
        return self._round[0] if self._round is not None else None

    @property
    def waiting_as_spare(self) -> bool:
        """True while next_round() waits with this node on the redundancy list."""
        return self._in_round and self._spare_since is not None

    # -- rounds --------------------------------------------------------------------------

    def _failed(self, exc: BaseException, what: str) -> RendezvousError | None:
        """Classify a failure: an error to raise now, or None to retry (a service that
        has been unreachable for less than the grace)."""
        from torch.distributed.elastic.rendezvous import api

        if isinstance(exc, api.RendezvousGracefulExitError | api.RendezvousClosedError):
            # A node dropped from its round (stopped for a while) that finds the job over
            # was not needed again: it ends like a spare, not as a failure.
            return _closed(self.endpoint, self._spare_since is not None, self._was_dropped)
        if isinstance(exc, self._unreachable):
            now = time.monotonic()
            if self._unreachable_since is None:
                self._unreachable_since = now
            if now - self._unreachable_since >= self._lost_grace:
                return RendezvousLost(self.backend, self.endpoint, exc)
            log.warning("rendezvous: %s: %s at %s did not answer (%s); retrying", what,
                        self.backend, self.endpoint, type(exc).__name__)
            return None
        if isinstance(exc, api.RendezvousTimeoutError) and self._spare_since is not None:
            return None  # a spare on a full wait list has a join timeout: it re-joins
        if isinstance(exc, api.RendezvousTimeoutError):
            return RendezvousError(f"no round formed at {self.endpoint} within join_timeout "
                                   f"{self.timings.join_timeout:g} s")
        return RendezvousError(f"rendezvous at {self.endpoint} failed: "
                               f"{type(exc).__name__} {exc}")

    def _torch_errors(self) -> tuple[type[BaseException], ...]:
        from torch.distributed.elastic.rendezvous import api

        # Not Exception: a signal handler's exception must pass through untouched.
        return (api.RendezvousError, RuntimeError, OSError, ValueError, *self._unreachable)

    def next_round(self) -> RoundInfo:
        """Join the next round (blocks). A node that finds the round full waits as a hot
        spare (``spare_waiting``) until a node is lost (``spare_admitted``)."""
        self._in_round, self._spare_since = True, None
        try:
            while True:
                try:
                    info = self.handler.next_rendezvous()
                    rnd = self._publish_master(info)
                    self._unreachable_since = None
                    break
                except self._torch_errors() as exc:
                    error = self._failed(exc, "next round")
                    if error is not None:
                        raise error from None
                    time.sleep(self.timings.poll_interval)
        finally:
            self._in_round = False
        if self._spare_since is not None:
            rnd.spare_wait_s = round(time.monotonic() - self._spare_since, 3)
            self._emit("spare_admitted", waited_s=rnd.spare_wait_s, round=rnd.round,
                       group_rank=rnd.group_rank, group_world_size=rnd.group_world_size)
        return rnd

    def _publish_master(self, info: Any) -> RoundInfo:
        """Group rank 0 picks the workers' master address; the others read it."""
        store = info.store  # prefixed per round by torch: no stale keys from a past round
        self._round = (store, info.world_size)
        state = self.handler._state_holder.state
        round_no = self._round_no = state.round
        left, self._members = gone(self._members, state), frozenset(state.participants)
        self._was_dropped = False
        if info.rank == 0:
            port = self.fixed_port or free_port("0.0.0.0")
            store.set(self.MASTER_KEY, f"{self.local_addr}:{port}")
            return RoundInfo(0, info.world_size, self.local_addr, port, round_no, left=left)
        wait_s = max(30.0, self.timings.dead_after)
        store.wait([self.MASTER_KEY], timedelta(seconds=wait_s))
        addr, _, port_text = store.get(self.MASTER_KEY).decode().rpartition(":")
        return RoundInfo(info.rank, info.world_size, addr, int(port_text), round_no, left=left)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join (a restart brings them in); spares are not counted.
        Raises RendezvousLost once the service has been unreachable past the grace."""
        return self.poll_round().waiting

    def poll_round(self) -> RoundView:
        """One read of the shared state while the workers run: nodes waiting to join, nodes
        of this round that were dropped, and whether this node itself was. Raises
        RendezvousLost once the service has been unreachable past the grace."""
        try:
            state = self._read_state()
        except self._torch_errors() as exc:
            error = self._failed(exc, "poll")
            if isinstance(error, RendezvousLost):
                raise error from None
            if error is not None:
                log.warning("rendezvous: cannot read the round's state: %s", error)
            return RoundView()
        self._unreachable_since = None
        dropped = out_of_round(state, self._node, self._round_no, self.timings.dead_after)
        lost = () if dropped or state.round != self._round_no else gone(self._members, state)
        return RoundView(waiting_to_join(state, self.max_nodes), lost, dropped)

    def standing(self, stalled_s: float) -> Standing:
        """Whether this node is still in the round it joined, after it was not running for
        ``stalled_s`` (a stopped launcher, or a rank's stop fence). Read from the shared
        state now, with a keep-alive interval of margin: a node whose last keep-alive is
        about to lapse is told it is out (its workers stop; everyone restarts once), never
        "current" a moment before the others drop it. When the service does not answer,
        a stall of the keep-alive expiry or more means the node is out."""
        if self._round_no is None:
            return Standing(True)
        try:
            state = self._read_state()
        except self._torch_errors() as exc:
            lapsed = stalled_s >= self.timings.dead_after
            return Standing(not lapsed, f"the rendezvous did not answer ({type(exc).__name__})"
                            + (f"; stopped {stalled_s:.1f} s, past the keep-alive expiry "
                               f"{self.timings.dead_after:g} s" if lapsed else ""), known=False)
        why = out_of_round(state, self._node, self._round_no, self.timings.dead_after,
                           margin_s=self.timings.keep_alive_interval)
        return Standing(why is None, why or "")

    @property
    def node_name(self) -> str:
        return str(self._node)

    def verdict_channel(self, rnd: RoundInfo) -> None:
        """torch's rendezvous shares no hang verdict: each node judges its own ranks."""
        return None

    def mark_dropped(self) -> None:
        """This node left its round because the others dropped it (the supervisor stopped
        its workers); if the job ends before it is needed again, it ends as a spare."""
        self._was_dropped = True

    def _read_state(self) -> Any:
        """The shared state, read now (torch's cached view, at most ``poll_interval`` old).
        torch drops nodes whose keep-alive lapsed from every state it reads, this node
        included: a node that was stopped past the expiry never finds itself in it again."""
        h = self.handler
        with h._heartbeat_lock:
            h._state_holder.sync()
            return h._state_holder.state

    def exit_barrier(self, wait: bool, timeout: float = 300.0) -> None:
        """Say this node is leaving; with ``wait``, also wait until every node of the round
        left, so a finished node does not close the rendezvous while another is still in
        it (that node's next_rendezvous would fail). A node that gives up only says so."""
        if self._round is None:
            return
        store, nodes = self._round
        key = "ft_launcher/exited"
        deadline = time.monotonic() + timeout
        try:
            done = store.add(key, 1)
            while wait and done < nodes and time.monotonic() < deadline:
                time.sleep(0.05)
                done = store.add(key, 0)
        except Exception as exc:  # the store's host may already be gone: nothing to wait for
            log.debug("exit barrier: %s", exc)
            return
        if wait and done < nodes:
            log.warning("exit barrier: %d of %d nodes finished after %.0f s", done, nodes,
                        timeout)

    def shutdown(self, close: bool = True) -> None:
        """``close``: close the job's rendezvous (the job is over for every node; a waiting
        spare then exits). Otherwise only leave it (this node stops alone, e.g. after a
        failed health check): keep-alives stop and this node leaves the round at once, so
        the others re-form without waiting for its keep-alive to lapse."""
        try:
            if close:
                self.handler.shutdown()
            else:
                self._leave()
        except Exception as exc:  # best effort at exit; the service may be gone
            log.debug("rendezvous shutdown: %s", exc)

    def _leave(self) -> None:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        h = self.handler
        h._stop_heartbeats()
        with h._heartbeat_lock:
            deadline = time.monotonic() + self.timings.close_timeout
            h._op_executor.run(dr._RendezvousExitOp(), deadline)
