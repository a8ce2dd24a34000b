"""Key-addressed media: stores of opaque values under opaque keys, shared or not.

A keyed medium knows nothing of pages, tenants, secrets or formats: ``kvtier.prefix.remote``
gives it store keys and framed values (``kvtier.tiers.frame``) and checks every value it gets back.

Contract of :class:`KeyedMedium` (every method takes a batch and is safe from any thread):
    * ``put_many(items, ttl_s) -> int``: writes every ``(key, value)``; returns how many were
      written. An item that could not be written is simply not counted (never raises for a store
      fault); ``ttl_s > 0`` asks the store to expire the value after that many seconds.
    * ``get_many(keys, max_bytes=None) -> list[bytes | None]``: one entry per key, ``None`` for a
      miss. Any fault (store down, slow past its deadline, a node gone) answers misses, never an
      exception. With ``max_bytes``, at most ``max_bytes + 1`` bytes of each value are read (a
      longer value comes back cut there: never more memory than that, whatever was planted).
    * ``contains_many(keys) -> list[bool]``: whether each key is present (no value transferred);
      faults answer ``False``.
    * No call waits past the medium's deadline. ``close()`` releases connections; calls after it
      answer misses.
    * ``health() -> MediumHealth``: reachable now, and the faults seen so far by kind.

:class:`DictMedium` is the in-memory medium: the test double, and the reference for the contract.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

Value = bytes | bytearray | memoryview


@dataclass(slots=True)
class MediumHealth:
    """What a medium knows about its store."""

    reachable: bool = True
    errors: dict[str, int] = field(default_factory=dict)  # kind (timeout, connection, ...) -> n


class KeyedMedium(ABC):
    """A batch key-value store; every fault is a miss (see the module contract)."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, Value]], ttl_s: int = 0) -> int: ...

    @abstractmethod
    def get_many(self, keys: Sequence[bytes], max_bytes: int | None = None
                 ) -> list[bytes | None]: ...

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def health(self) -> MediumHealth: ...

    def close(self) -> None:  # noqa: B027 - a medium without connections has nothing to close
        pass


class DictMedium(KeyedMedium):
    """A plain dict behind a lock. ``ttl_s`` is recorded, not enforced; ``down`` simulates a
    store that can't be reached (every call answers misses / writes nothing)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.ttls: dict[bytes, int] = {}
        self.down = False
        self._lock = threading.Lock()
        self._errors: dict[str, int] = {}

    def _fault(self) -> bool:
        if self.down:
            self._errors["connection"] = self._errors.get("connection", 0) + 1
        return self.down

    def put_many(self, items: Sequence[tuple[bytes, Value]], ttl_s: int = 0) -> int:
        with self._lock:
            if self._fault():
                return 0
            for key, value in items:
                self.data[bytes(key)] = bytes(value)
                self.ttls[bytes(key)] = ttl_s
            return len(items)

    def get_many(self, keys: Sequence[bytes], max_bytes: int | None = None
                 ) -> list[bytes | None]:
        with self._lock:
            if self._fault():
                return [None] * len(keys)
            got = [self.data.get(bytes(k)) for k in keys]
            end = None if max_bytes is None else max_bytes + 1
            return [None if v is None else v[:end] for v in got]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            if self._fault():
                return [False] * len(keys)
            return [bytes(k) in self.data for k in keys]

    def health(self) -> MediumHealth:
        with self._lock:
            return MediumHealth(not self.down, dict(self._errors))
