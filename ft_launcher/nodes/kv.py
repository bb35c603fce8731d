"""The one small key-value interface the rendezvous reaches its store through, and its
adapter for a c10d store (a ``TCPStore`` or a ``PrefixStore`` over one).

The rendezvous needs few operations, each a single request on every engine it runs on:
read one or several keys, write one, create one only if it is absent (the first writer
wins), add to a counter, and wait until a key exists. ``nodes.kv_etcd`` is the adapter
for etcd v3. Values are bytes; what the rendezvous keeps in them is small JSON
(``nodes.rounds`` encodes and checks it).

An adapter raises ``StoreUnreachable`` when the engine does not answer (a refused or broken
connection, a request past its timeout) and nothing else for that; a ``wait`` that reaches
its timeout returns None.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

log = logging.getLogger("ft_launcher")


class StoreUnreachable(ConnectionError):
    """The store did not answer: its host is gone, frozen or unreachable. ``refused``: every
    server refused the connection (nothing listens there: gone, not busy)."""

    def __init__(self, message: str = "", refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class KeyValue(Protocol):
    """What the rendezvous asks of a store (see the module docstring)."""

    def get(self, key: str) -> bytes | None: ...
    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]: ...
    def set(self, key: str, value: bytes) -> None: ...
    def create(self, key: str, value: bytes) -> bytes: ...
    def add(self, key: str, delta: int) -> int: ...
    def wait(self, key: str, timeout: float) -> bytes | None: ...
    def close(self) -> None: ...


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    import torch.distributed as dist

    return (dist.DistNetworkError, dist.DistStoreError, ConnectionError, TimeoutError,
            OSError)


class C10dKV:
    """``KeyValue`` over a torch c10d store (a ``TCPStore`` client, or a ``PrefixStore``).

    A c10d ``get`` of a missing key blocks until the store's timeout, so reads ask ``check``
    first; ``create`` is ``compare_set`` from the empty value (c10d reads a missing key as
    empty there). Not thread-safe: one client per thread that uses it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._errors = _unreachable_errors()
        self.requests = 0  # requests sent, for the benchmark's traffic figures
        self.bytes = 0  # keys and values sent and received

    def _count(self, *parts: str | bytes | None) -> None:
        self.requests += 1
        self.bytes += sum(len(p) for p in parts if p)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as exc:
            raise StoreUnreachable(f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                                   if str(exc) else type(exc).__name__) from None

    def get(self, key: str) -> bytes | None:
        self._count(key)
        if not self._call(self.store.check, [key]):
            return None
        value = self._call(self.store.get, key)
        self._count(key, value)
        return value

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Every key's value, None for a missing one. One request when all exist (the
        common case: keep-alive counters of nodes that joined), else one check per key."""
        keys = list(keys)
        if not keys:
            return []
        self._count(*keys)
        if self._call(self.store.check, keys):
            values = self._call(self.store.multi_get, keys)
            self._count(*keys, *values)
            return list(values)
        return [self.get(k) for k in keys]

    def set(self, key: str, value: bytes) -> None:
        self._count(key, value)
        self._call(self.store.set, key, value)

    def create(self, key: str, value: bytes) -> bytes:
        """Write ``value`` unless the key holds one already; the value the key holds now."""
        self._count(key, value, value)
        return self._call(self.store.compare_set, key, b"", value)

    def add(self, key: str, delta: int) -> int:
        self._count(key)
        return int(self._call(self.store.add, key, delta))

    def wait(self, key: str, timeout: float) -> bytes | None:
        """Block until ``key`` exists (the store pushes it: no polling), at most
        ``timeout`` seconds; its value, or None at the timeout."""
        import torch.distributed as dist

        self._count(key)
        try:
            self.store.wait([key], timedelta(seconds=max(timeout, 0.001)))
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                return None
            raise StoreUnreachable(f"DistStoreError: {exc}") from None
        except self._errors as exc:
            raise StoreUnreachable(f"{type(exc).__name__}: {exc}") from None
        return self.get(key)

    def close(self) -> None:
        self.store = None


def local_addresses() -> set[str]:
    """Names and addresses this machine answers to (torch's own test for "is host")."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            for info in socket.getaddrinfo(name, None):
                names.add(str(info[4][0]))
        except OSError:
            continue
    return names


def _store_timeout(seconds: float) -> timedelta:
    """A TCPStore's constructor timeout: at least 1 s, as torch 2.4 connects within the
    timeout's whole seconds (under 1 s: none, so a host cannot even reach its own store)."""
    return timedelta(seconds=max(seconds, 1.0))


def connect(host: str, port: int, timeout_s: float) -> Any:
    """A ``TCPStore`` client of the store at ``host:port``; raises StoreUnreachable."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=_store_timeout(timeout_s))
    except _unreachable_errors() as exc:
        raise StoreUnreachable(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    store.set_timeout(timedelta(seconds=timeout_s))  # requests: the timeout asked for
    return store


def host_store(addr: str, port: int, timeout_s: float) -> Any | None:
    """A ``TCPStore`` served by this process on ``port`` (0: the kernel picks), or None when
    the port is taken (another launcher on this machine hosts it: torch's rule too)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,
                             timeout=_store_timeout(timeout_s))
    except (dist.DistNetworkError, RuntimeError, OSError) as exc:
        log.debug("rendezvous: not hosting the store on port %d: %s", port, exc)
        return None
