"""The vLLM connector's link to the daemon: a cache that is away is a miss, never an error.

``DaemonLink(connect, what)``:

- ``client()`` — the daemon client, created on first use (creating it contacts nobody).
- ``ready()`` — ``False`` while the daemon was found away less than the current back-off ago
  (0.5 s, doubling to 2 s; after a timeout, a daemon that is there but does not answer, 5 s
  doubling to 30 s, or every lookup would wait out the whole timeout every 2 s); callers then
  skip the daemon (a miss, a skipped store).
- ``failed(exc)`` — record an outage: warns once per outage (not once per call), starts the
  back-off and drops the client, so the next try dials afresh instead of waiting out gRPC's own
  reconnect back-off (up to minutes). ``ok()`` — record a success: logs once when it is back.

Not thread-safe: each vLLM role calls its connector from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 2.0
_HUNG_FIRST_S, _HUNG_MAX_S = 5.0, 30.0  # after a timeout (``TimeoutError``: DeadlineExceeded)


class DaemonLink:
    def __init__(self, connect: Callable[[], Any], what: str, log: logging.Logger,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self._connect, self._what, self._log, self._clock = connect, what, log, clock
        self._client: Any = None
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = _FIRST_BACKOFF_S
        self.outages = 0

    def client(self) -> Any:
        if self._client is None:
            self._client = self._connect()
        return self._client

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def ready(self) -> bool:
        return self._down_since is None or self._clock() >= self._retry_at

    def failed(self, exc: BaseException) -> None:
        now = self._clock()
        hung = isinstance(exc, TimeoutError)
        if self._down_since is None:
            self._down_since = now
            self._backoff = _HUNG_FIRST_S if hung else _FIRST_BACKOFF_S
            self.outages += 1
            self._log.warning("kvtier: daemon unavailable for %s (%s); running without the "
                              "cache until it is back", self._what, exc)
        else:
            self._backoff = min(max(self._backoff * 2, _HUNG_FIRST_S if hung else 0.0),
                                _HUNG_MAX_S if hung else _MAX_BACKOFF_S)
        self._retry_at = now + self._backoff
        self.close()

    def ok(self) -> None:
        if self._down_since is not None:
            self._log.info("kvtier: daemon back for %s after %.1f s", self._what,
                           self._clock() - self._down_since)
            self._down_since = None
            self._backoff = _FIRST_BACKOFF_S

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
