"""One prefix across the ranks of a tensor-parallel engine: a hit only when every rank holds it.

A tensor-parallel engine runs one rank per GPU; each rank keeps its own shard of every KV block
in its own pool (attached or registered on its GPU) of one daemon, under rank-local keys (the
rank is part of the key, so rank 0's block never answers for rank 1's). The prefix a request may
reuse is the part that *every* rank can load: a block held by rank 0 but lost on rank 1 is
recomputed on both.

Contract (``TensorParallelPrefix(backend, handles)``, ``handles[r]`` = rank ``r``'s pool):
    * ``lookup(keys) -> int``: ``keys[r]`` are rank ``r``'s keys of one prefix (the same number
      for every rank). The common hit: the least, over ranks, of each rank's leading found keys
      (remote-tier answers count: ``load`` fetches them).
    * ``store(keys, slots) -> int``: each rank's blocks from its ``slots[r]``; the least stored.
    * ``load(keys, slots) -> int``: loads the common hit on every rank (at once, one thread per
      rank) and returns ``n``, the least any rank loaded. Tokens past block ``n`` must be
      recomputed on *every* rank: a rank that loaded more holds bytes past ``n`` it must treat
      as garbage. A load that fails on one rank with a runtime error (``PageLost``,
      ``CorruptPage``, ``Unavailable``, ``DeadlineExceeded``, ``CapacityError``) makes the
      answer 0 for every rank: the whole prefix is recomputed, never half of it reused.
    * A caller error (``InvalidArgument``, ``NotFound``, ``FailedPrecondition``, mismatched
      rank counts or lengths) raises before any load starts.
    * ``close()`` stops the rank threads (the pools stay attached: they are the caller's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.errors import (
    CapacityError,
    CorruptPage,
    DeadlineExceeded,
    InvalidArgument,
    PageLost,
    Unavailable,
)

from ._backend import Backend

log = logging.getLogger(__name__)
T = TypeVar("T")
# Runtime failures of one rank's load: the prefix is then a miss for every rank.
RANK_FAILURES = (PageLost, CorruptPage, Unavailable, DeadlineExceeded, CapacityError)


class TensorParallelPrefix:
    """See the module docstring."""

    def __init__(self, backend: Backend, handles: Sequence[Any]) -> None:
        if not handles:
            raise InvalidArgument("handles", "one pool per rank, got none")
        self._backend = backend
        self._handles = list(handles)
        self._threads = ThreadPoolExecutor(len(self._handles), thread_name_prefix="kvtier-tp")

    @property
    def ranks(self) -> int:
        return len(self._handles)

    def lookup(self, keys: Sequence[Sequence[bytes]]) -> int:
        """Blocks every rank holds, from the first (see the module docstring)."""
        self._check(keys)
        return min(len(self._backend.lookup(list(k))) for k in keys)

    def store(self, keys: Sequence[Sequence[bytes]], slots: Sequence[Sequence[int]]) -> int:
        """Each rank's blocks stored from its slots; the least any rank stored."""
        self._check(keys, slots)
        counts = self._each(lambda r: self._backend.store(self._handles[r], keys[r], slots[r]))
        return min(counts)

    def load(self, keys: Sequence[Sequence[bytes]], slots: Sequence[Sequence[int]]) -> int:
        """The common hit loaded on every rank; the blocks every rank may reuse (0 when a rank
        failed: see the module docstring)."""
        self._check(keys, slots)
        n = self.lookup(keys)
        if n == 0:
            return 0
        try:
            counts = self._each(
                lambda r: self._backend.load(self._handles[r], keys[r][:n], slots[r][:n])
            )
        except RANK_FAILURES as exc:
            log.warning("a rank failed to load a %d-block prefix (%s): every rank recomputes",
                        n, type(exc).__name__)
            return 0
        return min(counts)

    def close(self) -> None:
        self._threads.shutdown(wait=True)

    def __enter__(self) -> TensorParallelPrefix:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _each(self, call: Callable[[int], T]) -> list[T]:
        """``call(rank)`` for every rank at once; every call ends before this returns, and the
        first rank's error (in rank order) is raised."""
        futures = [self._threads.submit(call, r) for r in range(self.ranks)]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def _check(
        self, keys: Sequence[Sequence[bytes]], slots: Sequence[Sequence[int]] | None = None
    ) -> None:
        if len(keys) != self.ranks:
            raise InvalidArgument("keys", f"one list per rank ({self.ranks}), got {len(keys)}")
        if len({len(k) for k in keys}) > 1:
            raise InvalidArgument("keys", "every rank needs the same number of keys")
        if slots is None:
            return
        if len(slots) != self.ranks:
            raise InvalidArgument("slots", f"one list per rank ({self.ranks}), got {len(slots)}")
        for r, (k, s) in enumerate(zip(keys, slots, strict=True)):
            if len(s) != len(k):
                raise InvalidArgument(f"slots[{r}]", f"{len(s)} slots for {len(k)} keys")
