"""Stores that end after the engine's step: vLLM's ``request_finished``/``get_finished`` contract.

``StoreQueue(timeout_s)`` runs store jobs on one thread of its own, in submission order:

- ``submit(req_id, job, ready)``: run ``job()`` once ``ready`` (a CUDA event recorded on the
  stream that wrote the blocks, or ``None`` when the writes are already done) has completed. The
  caller keeps the source blocks unchanged until the request is reported by ``finished``.
- ``finished(delayed) -> set[str]``: ``delayed`` are requests whose blocks vLLM keeps alive until
  this worker reports them (the scheduler's ``request_finished`` returned True for them). Returns
  every request of this or an earlier call with no store left in flight; each exactly once.
- ``reap() -> list[BaseException]``: errors of finished jobs since the last call (the caller
  re-attaches); never raises.
- ``flush()``: wait until every submitted job has ended, without a bound of its own (preempted
  requests' blocks are about to be reused: no store may still read them; each store call is
  bounded by the client's deadline). ``close()``: wait at most ``timeout_s``, then stop the
  thread; jobs still queued then are dropped (a store that never ran is a later miss, never
  wrong).

A failed or dropped store is only a miss: the blocks it covers hold real KV, and a later block
stored without it is unreachable until it is stored again (lookups stop at the first missing key).
Thread-safety: the public methods are called from one thread (vLLM's worker); jobs run on the
queue's own thread.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any


class StoreQueue:
    def __init__(self, timeout_s: float = 30.0) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-store")
        self._timeout_s = timeout_s
        self._inflight: Counter[str] = Counter()
        self._jobs: list[tuple[str, Future[None]]] = []
        self._awaiting: set[str] = set()
        self._errors: list[BaseException] = []
        self._closed = threading.Event()

    @property
    def inflight(self) -> int:
        """Jobs submitted and not yet reaped as ended."""
        self._collect()
        return len(self._jobs)

    def submit(self, req_id: str, job: Callable[[], Any], ready: Any = None) -> None:
        if self._closed.is_set():
            return
        self._inflight[req_id] += 1
        self._jobs.append((req_id, self._pool.submit(self._run, job, ready)))

    def _run(self, job: Callable[[], Any], ready: Any) -> None:
        if self._closed.is_set():
            return  # shutting down past the bound: dropped
        if ready is not None:
            ready.synchronize()  # the forward's writes of these blocks are done
        job()

    def _collect(self) -> None:
        keep = []
        for req_id, fut in self._jobs:
            if not fut.done():
                keep.append((req_id, fut))
                continue
            self._inflight[req_id] -= 1
            if self._inflight[req_id] <= 0:
                del self._inflight[req_id]
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None:
                self._errors.append(exc)
        self._jobs = keep

    def reap(self) -> list[BaseException]:
        self._collect()
        out, self._errors = self._errors, []
        return out

    def finished(self, delayed: Iterable[str]) -> set[str]:
        self._awaiting.update(delayed)
        self._collect()
        done = {r for r in self._awaiting if r not in self._inflight}
        self._awaiting -= done
        return done

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every submitted job (at most ``timeout_s`` if given); ``False`` if some were
        still running at the bound."""
        futures = [f for _, f in self._jobs]
        if futures:
            wait_all(futures, timeout=timeout_s)
        self._collect()
        return not self._jobs

    def close(self) -> bool:
        """Flush within ``timeout_s``, then stop; ``True`` if nothing was left in flight."""
        clean = self.flush(self._timeout_s)
        self._closed.set()  # queued jobs not yet started are dropped
        self._pool.shutdown(wait=clean, cancel_futures=True)
        return clean
