"""The Redis / Valkey keyed medium (standalone or Cluster), on redis-py with hiredis.

Contract (that of ``kvtier.tiers.keyed.KeyedMedium``, plus):
    * One URL (``redis://[user@]host:port[/db]`` or ``rediss://`` for TLS; redis-py query options
      such as ``ssl_ca_certs`` pass through); the password comes separately, never in the URL.
      Whether the store is a Cluster is asked on connect (``INFO cluster``): a Cluster gets a
      cluster client, whose pipelines split every batch into one pipeline per node by hash slot.
    * Every call is bounded by ``timeout_s`` as a whole (a reply trickled in a byte at a time
      ends at its deadline, not only each socket read), and every socket operation by it too;
      redis-py's own retries are off, so a
      call answers within its deadline (per node of a Cluster batch) or fails into misses.
    * A connection fault or timeout marks the store unreachable for ``retry_after_s``: calls in
      that window answer misses at once (no call waits on a store known to be down), the next call
      after it tries again, so the medium reconnects by itself. Per-command errors (OOM, a slot
      whose node is gone) fail only their own items.
    * With no call for ``probe_s``, a PING asks the store (reconnecting if it was down), so
      ``health().reachable`` (``kvtier_remote_up``, status) is never older than ``probe_s`` plus
      the timeout: it said "up" for as long as the daemon made no call after the store died.
    * Faults are counted by kind (``connection``, ``timeout``, ``oom``, ``cluster``, ``other``);
      nothing logged names the password.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Connection, DefaultParser, PythonRespSerializer, SSLConnection
from redis.exceptions import NoPermissionError
from redis.exceptions import TimeoutError as RedisTimeout
from redis.retry import Retry

from kvtier.tiers.keyed import KeyedMedium, MediumHealth, Value

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1.0
PROBE_S = 5.0


class RedisMedium(KeyedMedium):
    def __init__(
        self, url: str, *, password: str | None, timeout_s: float,
        retry_after_s: float = RETRY_AFTER_S, probe_s: float = PROBE_S,
    ) -> None:
        self._url, self._password, self._timeout = url, password, timeout_s
        self._getrange = True  # False once the ACL user was refused GETRANGE (then GET)
        self._retry_after = retry_after_s
        self._lock = threading.Lock()  # guards the client, the back-off and the counters
        self._connected = threading.Condition(self._lock)  # a connect in progress ended
        self._client: Any = None
        self._down_until = 0.0
        self._reachable = False
        self._errors: dict[str, int] = {}
        self._node_down: dict[str, float] = {}  # Cluster node name -> back-off end
        self._closed = False
        self._connecting = False
        self.cluster = False
        self._probe_s, self._answered = probe_s, 0.0  # monotonic time of the last answer/fault
        self._stop = threading.Event()
        # Connect now, in the background: status shows the store's state from the start.
        threading.Thread(target=self._get, name="kvtier-remote-connect", daemon=True).start()
        threading.Thread(target=self._probe, name="kvtier-remote-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._stop.wait(self._probe_s):
            if time.monotonic() - self._answered >= self._probe_s:  # else calls answer for it
                self._command(lambda client: client.ping())

    # -- connection ----------------------------------------------------------------------------
    def _options(self) -> dict[str, Any]:
        tls = self._url.startswith("rediss://")
        return {
            "password": self._password, "socket_timeout": self._timeout,
            "socket_connect_timeout": self._timeout, "retry": Retry(NoBackoff(), 0),
            "client_name": "kvtier", "connection_class": _TLSConnection if tls else _Connection,
            "parser_class": _DeadlineParser,
        }

    def _connect(self) -> Any:
        plain = redis.Redis.from_url(self._url, **self._options())
        try:
            cluster = bool(plain.info("cluster").get("cluster_enabled"))
        except BaseException:
            plain.close()
            raise
        if not cluster:
            return plain
        plain.close()
        self.cluster = True
        return RedisCluster.from_url(self._url, require_full_coverage=False, **self._options())

    def _get(self) -> Any:
        """The client, connecting if needed (one thread connects, the others wait for it, all
        within the connect timeout); None while the store is known to be down."""
        with self._lock:
            if self._connecting:
                self._connected.wait_for(lambda: not self._connecting, 2 * self._timeout)
                return None if self._closed else self._client
            if self._closed or time.monotonic() < self._down_until:
                return None
            if self._client is not None:
                return self._client
            self._connecting = True
        client = exc = None
        try:
            client = self._connect()
        except Exception as err:
            exc = err
        with self._lock:
            self._connecting = False
            self._connected.notify_all()
            if exc is not None:
                self._fault_locked(exc)
                return None
            if self._closed:
                client.close()
                return None
            self._client, self._reachable = client, True
            return client

    def _fault_locked(self, exc: BaseException, node: str = "") -> str:
        self._answered = time.monotonic()
        kind = _kind(exc)
        self._errors[kind] = self._errors.get(kind, 0) + 1
        if kind in ("connection", "timeout", "cluster", "protocol"):  # unusable for now
            if self._reachable:
                log.warning("remote store %sunreachable (%s): %s", f"node {node} " if node else "",
                            kind, type(exc).__name__)
            self._reachable = False
            until = time.monotonic() + self._retry_after
            if node:
                self._node_down[node] = until
            else:
                self._down_until = until
        if kind == "cluster" and self._client is not None and self.cluster:
            try:
                self._client.nodes_manager.initialize()  # slots moved: ask the nodes again
            except Exception:
                self._down_until = time.monotonic() + self._retry_after
        return kind

    def _ok(self) -> None:
        with self._lock:
            self._answered = time.monotonic()
            if not self._reachable:
                log.info("remote store reachable%s", " (cluster)" if self.cluster else "")
            self._reachable = True

    def _run(self, conn: Any, keys: Sequence[Any], add: Callable[[Any, Any], None],
             node: str = "") -> list[Any] | None:
        """One pipeline on one connection: per-item results (an exception instance for a failed
        item), or None when the whole pipeline failed (counted)."""
        try:
            pipe = conn.pipeline(transaction=False)
            for key in keys:
                add(pipe, key)
            _CALL.deadline = time.monotonic() + self._timeout
            results: list[Any] = pipe.execute(raise_on_error=False)
        except Exception as exc:
            with self._lock:
                self._fault_locked(exc, node)
            return None
        finally:
            _CALL.deadline = 0.0
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            with self._lock:
                self._fault_locked(errors[0], node)
        if len(errors) < len(results):
            self._ok()
        return results

    def _pipeline(self, keys: Sequence[Any], add: Callable[[Any, Any], None],
                  key_of: Callable[[Any], bytes] = bytes) -> list[Any] | None:
        """Per-item results of one batch (None for an item whose pipeline failed), or None when
        the store is down. A Cluster batch becomes one pipeline per node, each failing alone."""
        client = self._get()
        if client is None or not keys:
            return None
        if not self.cluster:
            return self._run(client, keys, add)
        out: list[Any] = [None] * len(keys)
        for name, node, idx in self._by_node(client, keys, key_of):
            with self._lock:
                if time.monotonic() < self._node_down.get(name, 0.0):
                    continue  # this node failed just now: its items are misses at once
            got = self._run(client.get_redis_connection(node), [keys[i] for i in idx], add, name)
            for i, r in zip(idx, got or (), strict=False):
                out[i] = r
        return out

    def _by_node(self, client: Any, keys: Sequence[Any],
                 key_of: Callable[[Any], bytes]) -> list[tuple[str, Any, list[int]]]:
        groups: dict[str, tuple[Any, list[int]]] = {}
        try:
            for i, key in enumerate(keys):
                node = client.get_node_from_key(key_of(key))
                groups.setdefault(node.name, (node, []))[1].append(i)
        except Exception as exc:  # no node holds a slot (cluster down): all misses
            with self._lock:
                self._fault_locked(exc)
            return []
        return [(name, node, idx) for name, (node, idx) in groups.items()]

    # -- KeyedMedium ---------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Value]], ttl_s: int = 0) -> int:
        ex = ttl_s if ttl_s > 0 else None
        results = self._pipeline(items, lambda p, kv: p.set(kv[0], kv[1], ex=ex), _first)
        return 0 if results is None else sum(r is True for r in results)

    def get_many(self, keys: Sequence[bytes], max_bytes: int | None = None
                 ) -> list[bytes | None]:
        if max_bytes is not None and self._getrange:  # a value planted larger: read that far
            results = self._pipeline(keys, lambda p, k: p.getrange(k, 0, max_bytes))
            if results and all(isinstance(r, NoPermissionError) for r in results):
                self._getrange = False  # an ACL user of an older release: GET, and say so
                log.warning("remote store: the ACL user may not GETRANGE; reading whole values "
                            "with GET (add +getrange: docs/operations.md, Remote tier)")
                return self.get_many(keys)
        else:
            results = self._pipeline(keys, lambda p, k: p.get(k))
        if results is None:
            return [None] * len(keys)
        return [r if isinstance(r, bytes) and r else None for r in results]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        # Standalone: one multi-key EXISTS first (its count answers "all" or "none" in one
        # round trip, a fifth of a 64-command pipeline's client cost); per-key only when mixed.
        count = self._count(keys) if not self.cluster and len(keys) > 1 else None
        if count is not None and count in (0, len(keys)):
            return [count > 0] * len(keys)
        results = self._pipeline(keys, lambda p, k: p.exists(k))
        if results is None:
            return [False] * len(keys)
        return [r == 1 for r in results]

    def _count(self, keys: Sequence[bytes]) -> int | None:
        """How many of ``keys`` exist (a key given twice counts twice), or None on a fault (a
        reply that is not a count too: a Lookup then answers misses, never an error)."""
        count: int | None = self._command(lambda client: _count_of(client.exists(*keys)))
        return count

    def _command(self, call: Callable[[Any], Any]) -> Any:
        """One command on the client within the timeout: its reply, or None (down, in its
        back-off, or a fault, counted)."""
        client = self._get()
        if client is None:
            return None
        try:
            _CALL.deadline = time.monotonic() + self._timeout
            reply = call(client)
        except Exception as exc:
            with self._lock:
                self._fault_locked(exc)
            return None
        finally:
            _CALL.deadline = 0.0
        self._ok()
        return reply

    def health(self) -> MediumHealth:
        with self._lock:
            return MediumHealth(self._reachable, dict(self._errors))

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            if self._client is not None:
                self._client.close()
                self._client = None


class _Deadline(threading.local):
    deadline = 0.0  # monotonic end of this thread's call in progress (0: none)


_CALL = _Deadline()


class _DeadlineParser(DefaultParser):  # type: ignore[misc,valid-type]
    """Each read from the socket first checks the thread's call deadline: a store that sends
    its reply a byte at a time (each read within the socket timeout) still ends the call."""

    def read_from_socket(self, *args: Any, **kwargs: Any) -> Any:
        if _CALL.deadline and time.monotonic() > _CALL.deadline:
            raise RedisTimeout("kvtier: the call's deadline passed mid-reply")
        return super().read_from_socket(*args, **kwargs)


class _ValuesUncopied:
    """Send large values as they are (``sendall`` of the caller's buffer). redis-py with hiredis
    packs every command into one new bytes object (and copies a memoryview first): two copies of
    every page. Replies are still parsed by hiredis."""

    _buffer_cutoff: int
    encoder: Any

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class _Connection(_ValuesUncopied, Connection):
    pass


class _TLSConnection(_ValuesUncopied, SSLConnection):
    pass


def _first(item: tuple[bytes, Value]) -> bytes:
    return item[0]


def _kind(exc: BaseException) -> str:
    from redis import exceptions as rx

    if isinstance(exc, rx.TimeoutError):
        return "timeout"
    if isinstance(exc, rx.OutOfMemoryError) or str(exc).startswith("OOM"):
        return "oom"
    if isinstance(exc, rx.ClusterError | rx.ClusterDownError | rx.SlotNotCoveredError
                  | rx.AskError | rx.TryAgainError):
        return "cluster"
    if isinstance(exc, rx.ConnectionError | OSError):
        return "connection"
    if isinstance(exc, rx.RedisClusterException):
        return "cluster"
    if isinstance(exc, rx.InvalidResponse | TypeError | ValueError):
        return "protocol"  # not RESP, or the wrong reply type: not a Redis we can use
    return "other"


def _count_of(reply: Any) -> int:
    """An integer reply, or ``TypeError`` (a counted fault in ``_command``)."""
    if isinstance(reply, bool) or not isinstance(reply, int):
        raise TypeError(f"EXISTS answered {type(reply).__name__}, not an integer")
    return reply
