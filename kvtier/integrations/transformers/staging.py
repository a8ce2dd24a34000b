"""The staging pool a :class:`~.cache.ConversationStore` copies keyed blocks through.

``StagingSlots(backend, num_slots, page_size)`` attaches a pool and pins every slot once, for the
store's life (consecutive slots, in order): loads and stores then copy through them without an
allocate / release / free per call.

- ``load(keys, take, first, nbytes) -> int``: load the leading loadable blocks of ``keys`` into
  the slots and hand ``take`` their bytes (a view of the slots; a copy if not consecutive); what
  ``take`` enqueues on the current stream is waited for before the slots are written again.
- ``store(keys, rows) -> int``: write ``rows`` into the slots and store them under ``keys``.
- ``handle``: the current pool's (an engine lends its pages through it).
- ``close()``: detach; idempotent, and a target that no longer knows the pool (a restarted
  daemon) or is gone is not an error.

Contract: a load or store that failed (any error, a timeout included) may still have a copy
under way into or out of the slots: the engine or daemon finishes the chunk it had started even
after the caller gave up. Such a pool is poisoned: it is detached at once (detaching waits for
its copies) and a fresh pool is attached before the next copy, so no slot a failed call may
still write is ever read. ``replaced`` counts the pools given up that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import suppress

import torch

from kvtier.client._backend import Backend, Staging
from kvtier.errors import CapacityError, FailedPrecondition, NotFound, Unavailable

from .pool import staged_rows, write_rows

Take = Callable[[torch.Tensor, int], object]  # (rows [n, raw] uint8, index of the first block)
_GONE = (NotFound, FailedPrecondition, Unavailable)  # the pool is no longer attached anyway


class StagingSlots:
    """See the module docstring."""

    def __init__(self, backend: Backend, num_slots: int, page_size: int) -> None:
        self.backend, self.num_slots, self.page_size = backend, num_slots, page_size
        self.replaced = 0
        self._staged: torch.cuda.Event | None = None  # recorded after the last read of a pool
        self._pool: Staging | None = None
        self._slots: list[int] = []
        self._closed = False
        self._attach()

    def _attach(self) -> Staging:
        pool = self.backend.attach(self.num_slots, self.page_size)
        try:
            got = self.backend.allocate(pool.handle, self.num_slots)
            if got is None:
                raise CapacityError(f"staging_slots: could not pin {self.num_slots} slots of a "
                                    "new staging pool")
        except BaseException:
            with suppress(Exception):
                self.backend.detach(pool.handle)
            raise
        self._pool, self._slots = pool, sorted(s for _, s in got)
        return pool

    def _current(self) -> Staging:
        if self._closed:
            raise FailedPrecondition("the store is closed")
        return self._pool if self._pool is not None else self._attach()

    @property
    def handle(self) -> object:
        """The pool's handle (attaching a fresh pool if the last was given up)."""
        return self._current().handle

    def _reads_done(self) -> None:
        """Wait until what was read out of the slots has been copied (a load or store may
        overwrite them next; a detach frees them)."""
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None

    def _poison(self) -> None:
        """Give up the pool after a failed call (see the module docstring)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            self.replaced += 1
            self._reads_done()
            with suppress(Exception):  # the call's own error is the one to raise
                self.backend.detach(pool.handle)

    def load(self, keys: Sequence[bytes], take: Take, first: int, nbytes: int) -> int:
        pool = self._current()
        slots = self._slots[: len(keys)]
        self._reads_done()
        try:
            got = self.backend.load(pool.handle, keys, slots)
        except BaseException:
            self._poison()
            raise
        if got:
            take(staged_rows(pool, slots[:got], nbytes), first)
            if pool.rows.is_cuda:
                self._staged = torch.cuda.Event()
                self._staged.record()
        return got

    def store(self, keys: Sequence[bytes], rows: torch.Tensor) -> int:
        pool = self._current()
        slots = self._slots[: len(keys)]
        self._reads_done()
        write_rows(pool, slots, rows)
        try:
            return self.backend.store(pool.handle, keys, slots)
        except BaseException:
            self._poison()
            raise

    def close(self) -> None:
        pool, self._pool, self._closed = self._pool, None, True
        if pool is None:
            return
        self._reads_done()
        with suppress(*_GONE):
            self.backend.detach(pool.handle)
