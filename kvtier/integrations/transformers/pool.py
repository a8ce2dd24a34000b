"""Pool pages for ``ConversationStore(..., keep_on_gpu=True)`` (see ``cache``).

Instead of keyed pages (CPU and disk tiers only), a conversation's blocks live as ordinary pages
of one attached pool, so they start on the GPU tier and the engine moves them like any other
page:

- save: ``allocate`` pages (pinned, on the GPU), copy each block's bytes into their slots,
  ``release`` them; remember chained block key -> page id.
- restore: ``acquire`` the longest run of known pages (the engine first restores any it offloaded
  to CPU or disk), copy their slots out, ``release``.

:class:`PoolPages` holds that map for one store: one tenant, one pool, so pages are never shared
across tenants. The pages die with the pool (``close``); keyed copies are not made.

Tiers: each page's tier is read just before the acquire (``page_info`` in-process,
``page_tiers`` through the daemon, one call per chunk).
A page whose bytes were dropped (``PageLost``) ends the restored prefix there and is forgotten,
with the later blocks of that request: never wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress

import torch

from kvtier.client._backend import Backend, ClientBackend, EngineBackend, Staging
from kvtier.errors import FailedPrecondition, NotFound, PageLost, Unavailable
from kvtier.types import Tier


def write_rows(pool: Staging, slots: Sequence[int], rows: torch.Tensor) -> None:
    """Copy ``rows`` (``[n, <= page_size]`` uint8) into ``slots`` of ``pool``, zero-padded."""
    dst = pool.rows
    idx = torch.tensor(list(slots), device=dst.device)
    padded = torch.zeros(len(slots), pool.page_size, dtype=torch.uint8, device=dst.device)
    padded[:, : rows.shape[1]] = rows.to(dst.device)
    dst.index_copy_(0, idx, padded)
    if dst.is_cuda:
        torch.cuda.synchronize(dst.device)


def read_rows(pool: Staging, slots: Sequence[int], nbytes: int) -> torch.Tensor:
    """A copy of the first ``nbytes`` of each of ``slots`` (``[n, nbytes]`` uint8)."""
    idx = torch.tensor(list(slots), device=pool.rows.device)
    return pool.rows.index_select(0, idx)[:, :nbytes]


def staged_rows(pool: Staging, slots: Sequence[int], nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of each of ``slots``: a view when the slots are consecutive,
    else a copy (``[n, nbytes]`` uint8). A view is only valid while the slots are held."""
    first = slots[0]
    if list(slots) == list(range(first, first + len(slots))):
        return pool.rows[first : first + len(slots), :nbytes]
    return read_rows(pool, slots, nbytes)


class PoolPages:
    """A store's blocks as pages of one attached pool, found by chained block key."""

    def __init__(self, backend: Backend, num_slots: int, page_size: int) -> None:
        if not isinstance(backend, (EngineBackend, ClientBackend)):
            raise TypeError(f"pool pages need an engine or a client, got {type(backend).__name__}")
        self.backend = backend
        self.pool: Staging = backend.attach(num_slots, page_size)
        self.pages: dict[bytes, int] = {}
        self._closed = False

    @property
    def pool_id(self) -> int:
        return int(self.pool.handle.pool_id)

    def page_ids(self) -> list[int]:
        """Every page this store holds, oldest first."""
        return list(self.pages.values())

    def close(self) -> None:
        """Detach the pool (its pages are freed). Idempotent; a daemon that no longer knows the
        pool (restarted) or is gone is not an error."""
        self.pages.clear()
        if self._closed:
            return
        self._closed = True
        with suppress(NotFound, FailedPrecondition, Unavailable):
            self.backend.detach(self.pool.handle)

    def known(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a page."""
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    # --- save -----------------------------------------------------------------------------------
    def save(self, keys: Sequence[bytes], rows: torch.Tensor) -> int:
        """New pages holding ``rows[i]`` for ``keys[i]``; stops early if no slot is free."""
        saved, step, b, h = 0, self.pool.num_slots, self.backend, self.pool.handle
        for i in range(0, len(keys), step):
            chunk = list(keys[i : i + step])
            got = b.allocate(h, len(chunk))
            if got is None:
                break
            ids, slots = [p for p, _ in got], [s for _, s in got]
            try:
                write_rows(self.pool, slots, rows[i : i + len(chunk)])
            except BaseException:
                b.release(h, ids)
                b.free(h, ids)
                raise
            b.release(h, ids)
            self.pages.update(zip(chunk, ids, strict=True))
            saved += len(chunk)
        return saved

    # --- restore --------------------------------------------------------------------------------
    def load(
        self, keys: Sequence[bytes], nbytes: int
    ) -> tuple[torch.Tensor | None, list[Tier | None]]:
        """Bytes (``[n, nbytes]``) of the longest loadable run of known leading ``keys`` and the
        tier each block was on before the acquire; ``(None, [])`` if none."""
        known = list(keys[: self.known(keys)])
        parts: list[torch.Tensor] = []
        tiers: list[Tier | None] = []
        step = self.pool.num_slots
        for i in range(0, len(known), step):
            chunk = known[i : i + step]
            ids = [self.pages[k] for k in chunk]
            before = self._tiers(ids)
            slots, lost = self._acquire(ids)
            if slots:
                try:
                    parts.append(read_rows(self.pool, slots, nbytes))
                finally:
                    self.backend.release(self.pool.handle, ids[: len(slots)])
                tiers += before[: len(slots)]
            if lost:
                self._forget(known[i + len(slots) :])
            if len(slots) < len(chunk):
                break
        if not parts:
            return None, []
        return (torch.cat(parts) if len(parts) > 1 else parts[0]), tiers

    def _acquire(self, ids: list[int]) -> tuple[list[int], bool]:
        """Pinned slots of the leading acquirable ``ids``, and whether a page was lost.

        All of ``ids`` unless the pool is too busy to pin them (``[]``, False) or a page's bytes
        were dropped (the slots before the first lost page, True)."""
        try:
            got = self._acquire_raw(ids)
            return ([], False) if got is None else (got, False)
        except PageLost:
            pass
        slots: list[int] = []
        for pid in ids:
            try:
                one = self._acquire_raw([pid])
            except PageLost:
                return slots, True
            if one is None:
                break
            slots += one
        return slots, False

    def _acquire_raw(self, ids: list[int]) -> list[int] | None:
        b = self.backend
        if isinstance(b, EngineBackend):
            got = b.engine.acquire(self.pool.handle.pool_id, ids)
        else:
            assert isinstance(b, ClientBackend)
            got = b.client.acquire(self.pool.handle, ids)
        return None if got is None else [int(s) for s in got]

    def _tiers(self, page_ids: list[int]) -> list[Tier | None]:
        """Where each page is now (``None``: its bytes were dropped)."""
        b, pool = self.backend, self.pool.handle
        if isinstance(b, EngineBackend):
            infos = [b.engine.page_info(pool.pool_id, p) for p in page_ids]
            return [None if i.tier is None else Tier(i.tier) for i in infos]
        assert isinstance(b, ClientBackend)
        return b.client.page_tiers(pool, page_ids)

    def _forget(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` from the map and free their pages (a lost page and what followed it)."""
        ids = [self.pages.pop(k) for k in keys if k in self.pages]
        if ids:
            self.backend.free(self.pool.handle, ids)
