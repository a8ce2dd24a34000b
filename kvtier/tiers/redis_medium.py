"""The Redis / Valkey keyed medium (standalone or Cluster), on redis-py with hiredis.

Contract (that of ``kvtier.tiers.keyed.KeyedMedium``, plus):
    * One URL (``redis://[user@]host:port[/db]`` or ``rediss://`` for TLS; redis-py query options
      such as ``ssl_ca_certs`` pass through); the password comes separately, never in the URL.
      Whether the store is a Cluster is asked on connect (``INFO cluster``): a Cluster gets a
      cluster client, whose pipelines split every batch into one pipeline per node by hash slot.
    * Every socket operation is bounded by ``timeout_s``; redis-py's own retries are off, so a
      call answers within its deadline (per node of a Cluster batch) or fails into misses.
    * A connection fault or timeout marks the store unreachable for ``retry_after_s``: calls in
      that window answer misses at once (no call waits on a store known to be down), the next call
      after it tries again, so the medium reconnects by itself. Per-command errors (OOM, a slot
      whose node is gone) fail only their own items.
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
from redis.retry import Retry

from kvtier.tiers.keyed import KeyedMedium, MediumHealth

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1.0


class RedisMedium(KeyedMedium):
    def __init__(
        self, url: str, *, password: str | None, timeout_s: float,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self._url, self._password, self._timeout = url, password, timeout_s
        self._retry_after = retry_after_s
        self._lock = threading.Lock()  # guards the client, the back-off and the counters
        self._client: Any = None
        self._down_until = 0.0
        self._reachable = False
        self._errors: dict[str, int] = {}
        self._closed = False
        self.cluster = False

    # -- connection ----------------------------------------------------------------------------
    def _options(self) -> dict[str, Any]:
        return {
            "password": self._password, "socket_timeout": self._timeout,
            "socket_connect_timeout": self._timeout, "retry": Retry(NoBackoff(), 0),
            "client_name": "kvtier",
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
        """The client, connecting if needed; None while the store is known to be down."""
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return None
            if self._client is None:
                try:
                    self._client = self._connect()
                except Exception as exc:
                    self._fault_locked(exc)
                    return None
            return self._client

    def _fault_locked(self, exc: BaseException) -> str:
        kind = _kind(exc)
        self._errors[kind] = self._errors.get(kind, 0) + 1
        if kind in ("connection", "timeout", "cluster"):
            if self._reachable:
                log.warning("remote store unreachable (%s): %s", kind, type(exc).__name__)
            self._reachable = False
            self._down_until = time.monotonic() + self._retry_after
        return kind

    def _fault(self, exc: BaseException) -> None:
        with self._lock:
            if self._fault_locked(exc) == "cluster" and self._client is not None:
                self._client.close()  # a changed topology: ask the nodes again on reconnect
                self._client = None

    def _ok(self) -> None:
        with self._lock:
            if not self._reachable:
                log.info("remote store reachable%s", " (cluster)" if self.cluster else "")
            self._reachable = True

    def _pipeline(self, keys: Sequence[Any], add: Callable[[Any, Any], None]) -> list[Any] | None:
        """One pipelined batch; per-item results (an exception instance for a failed item), or
        None when the whole batch failed."""
        client = self._get()
        if client is None or not keys:
            return None
        try:
            pipe = client.pipeline(transaction=False) if not self.cluster else client.pipeline()
            for key in keys:
                add(pipe, key)
            results: list[Any] = pipe.execute(raise_on_error=False)
        except Exception as exc:
            self._fault(exc)
            return None
        errors = [r for r in results if isinstance(r, Exception)]
        for err in errors[:1]:
            self._fault(err)
        if len(errors) < len(results):
            self._ok()
        return results

    # -- KeyedMedium ---------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: int = 0) -> int:
        ex = ttl_s if ttl_s > 0 else None
        results = self._pipeline(items, lambda p, kv: p.set(kv[0], kv[1], ex=ex))
        return 0 if results is None else sum(r is True for r in results)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        results = self._pipeline(keys, lambda p, k: p.get(k))
        if results is None:
            return [None] * len(keys)
        return [r if isinstance(r, bytes) else None for r in results]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        results = self._pipeline(keys, lambda p, k: p.exists(k))
        if results is None:
            return [False] * len(keys)
        return [r == 1 for r in results]

    def health(self) -> MediumHealth:
        with self._lock:
            return MediumHealth(self._reachable, dict(self._errors))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._client is not None:
                self._client.close()
                self._client = None


def _kind(exc: BaseException) -> str:
    from redis import exceptions as rx

    if isinstance(exc, rx.TimeoutError):
        return "timeout"
    if isinstance(exc, rx.ResponseError) and str(exc).startswith("OOM"):
        return "oom"
    if isinstance(exc, rx.ClusterError | rx.ClusterDownError | rx.SlotNotCoveredError):
        return "cluster"
    if isinstance(exc, rx.ConnectionError | OSError):
        return "connection"
    if isinstance(exc, rx.RedisClusterException):
        return "cluster"
    return "other"
