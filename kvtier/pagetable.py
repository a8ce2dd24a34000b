"""The page table: the one place where page state lives.

Contract:
    * Every page is in exactly one :class:`PageState`; ``tier``/``slot`` say where its bytes are
      (while moving: the source, which stays valid until the move completes).
    * ``pins`` > 0 means an engine is using the page on the GPU: it never moves or is evicted.
    * A page with ``pool_id is None`` is a *keyed* page (a stored prefix block) owned by ``tenant``;
      keyed pages live in the CPU and disk tiers only.
    * The table is not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from kvtier.batches import split_by
from kvtier.errors import NotFound
from kvtier.types import PageId, PageMeta, PageState, PoolId, Tier

if TYPE_CHECKING:
    from kvtier.transfer.base import Moves


@dataclass(slots=True, eq=False)
class Page:
    """One logical page. Mutated only by the engine under its lock."""

    page_id: PageId
    pool_id: PoolId | None
    tenant: str
    page_size: int
    state: PageState
    tier: Tier
    slot: int
    priority: float = 1.0
    position: int = 0
    length: int = 1
    pins: int = 0
    hits: int = 0
    key: bytes | None = None
    move: Moves | None = None  # the batch it was prepared in (state MOVING_*), else None
    doomed: bool = False  # freed while moving: release everything when the move completes
    ready: Any = None  # CUDA event recorded when the engine last released the page
    # Acquires waiting for this page to reach the GPU. A tuple, replaced and never mutated, so
    # one acquire shares a single ``(wait,)`` between all its pages.
    waits: tuple[AcquireWait, ...] | None = None
    _meta: PageMeta | None = field(default=None, repr=False)  # meta(), until priority changes

    def meta(self) -> PageMeta:
        """What policies see of the page; built once and rebuilt when its priority changes
        (position and length are fixed at creation)."""
        meta = self._meta
        if meta is None or meta.priority != self.priority:
            meta = self._meta = PageMeta(self.page_id, self.priority, self.position, self.length)
        return meta

    @property
    def moving(self) -> bool:
        return self.state in (PageState.MOVING_DOWN, PageState.MOVING_UP)


@dataclass(slots=True, eq=False)
class AcquireWait:
    """One acquire's progress, advanced by move completions (never by rescanning pages).

    A page that lands on the GPU is pinned for the waiting acquire at once (so nothing can evict
    it before the acquire wakes) and counted down from ``left``; a page that lands in the CPU
    tier (the disk leg of a restore) is queued in ``on_cpu`` for its GPU leg; ``on_disk`` and
    ``lost`` report pages that went down or were dropped meanwhile.
    """

    left: int = 0
    pinned: list[Page] = field(default_factory=list)
    on_cpu: list[Page] = field(default_factory=list)
    on_disk: list[Page] = field(default_factory=list)
    lost: list[PageId] = field(default_factory=list)


def advance_waits_many(pages: list[Page], pinned: set[PageId]) -> None:
    """``advance_waits`` of each page (all with waits), the GPU arrivals pinned in one pass
    per distinct set of waiting acquires (usually one: the acquire that restored them)."""
    gpu = PageState.GPU
    landed = [p for p in pages if p.state is gpu]
    if landed:
        keys = [p.waits for p in landed]
        for waits, (group,) in split_by(keys, landed):
            assert waits is not None
            n = len(waits)
            for page in group:
                page.waits = None
                page.pins += n
            for wait in waits:
                wait.pinned += group
                wait.left -= len(group)
        pinned.update([p.page_id for p in landed])
    if len(landed) < len(pages):
        for page in pages:
            if page.state is not gpu:
                advance_waits(page, pinned)


def advance_waits(page: Page, pinned: set[PageId]) -> None:
    """Tell the acquires waiting on ``page`` where it settled.

    On the GPU it is pinned once per waiting acquire (``pinned``: its pool's pinned set) before
    anything can evict it; dropped, it is reported lost; in CPU or on disk, queued for the next leg.
    """
    waits = page.waits
    assert waits is not None
    if page.state is PageState.GPU:
        for wait in waits:
            page.pins += 1
            pinned.add(page.page_id)
            wait.pinned.append(page)
            wait.left -= 1
        page.waits = None
    elif page.state is PageState.DROPPED:
        for wait in waits:
            wait.lost.append(page.page_id)
        page.waits = None
    else:
        for wait in waits:
            (wait.on_cpu if page.state is PageState.CPU else wait.on_disk).append(page)


def _by_pool(pages: list[Page]) -> dict[PoolId | None, list[Page]]:
    first = pages[0].pool_id if pages else None
    if all(p.pool_id == first for p in pages):
        return {first: pages} if pages else {}
    out: dict[PoolId | None, list[Page]] = {}
    for page in pages:
        out.setdefault(page.pool_id, []).append(page)
    return out


@dataclass(slots=True)
class PageTable:
    """Pages by id, by pool and by (salted) content key."""

    pages: dict[PageId, Page] = field(default_factory=dict)
    by_pool: dict[PoolId, set[PageId]] = field(default_factory=dict)
    by_key: dict[bytes, PageId] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def new_id(self) -> PageId:
        return PageId(next(self._ids))

    def add(self, page: Page) -> None:
        assert page.page_id not in self.pages
        self.pages[page.page_id] = page
        if page.pool_id is not None:
            self.by_pool.setdefault(page.pool_id, set()).add(page.page_id)
        if page.key is not None:
            self.by_key[page.key] = page.page_id

    def new_ids(self, n: int) -> list[PageId]:
        return cast("list[PageId]", list(itertools.islice(self._ids, n)))

    def add_pool_pages(self, pool_id: PoolId, pages: list[Page]) -> None:
        """``add`` of new pages of one pool (pool pages carry no content key), in one call."""
        fresh = {p.page_id: p for p in pages}
        assert len(fresh) == len(pages) and self.pages.keys().isdisjoint(fresh)
        self.pages.update(fresh)
        self.by_pool.setdefault(pool_id, set()).update(fresh)

    def remove_many(self, pages: list[Page]) -> None:
        """``remove`` of each."""
        for pool_id, group in _by_pool(pages).items():
            ids = [p.page_id for p in group]
            for page_id in ids:
                self.pages.pop(page_id, None)
            if pool_id is not None:
                self.by_pool.get(pool_id, set()).difference_update(ids)
        for page in pages:
            if page.key is not None and self.by_key.get(page.key) == page.page_id:
                del self.by_key[page.key]

    def remove(self, page: Page) -> None:
        self.pages.pop(page.page_id, None)
        if page.pool_id is not None:
            self.by_pool.get(page.pool_id, set()).discard(page.page_id)
        if page.key is not None and self.by_key.get(page.key) == page.page_id:
            del self.by_key[page.key]

    def get(self, pool_id: PoolId, page_id: PageId) -> Page:
        """The pool's page; ``NotFound`` for unknown ids and for pages of other pools."""
        page = self.pages.get(page_id)
        if page is None or page.pool_id != pool_id:
            raise NotFound(f"page {page_id} not found in pool {pool_id}")
        return page

    def get_many(self, pool_id: PoolId, page_ids: Sequence[PageId]) -> list[Page]:
        """``get`` of each id, in order (one pass; the same ``NotFound`` for the first bad id)."""
        found = list(map(self.pages.get, page_ids))
        if None not in found:
            pages = cast("list[Page]", found)
            if all(p.pool_id == pool_id for p in pages):
                return pages
        for page_id in page_ids:
            self.get(pool_id, page_id)  # raises for the first bad id
        raise AssertionError("unreachable: a page was missing or of another pool")

    def keyed(self, key: bytes) -> Page | None:
        pid = self.by_key.get(key)
        return self.pages.get(pid) if pid is not None else None

    def of_pool(self, pool_id: PoolId) -> list[Page]:
        return [self.pages[p] for p in self.by_pool.get(pool_id, ())]

    def count(self, state: PageState) -> int:
        return sum(1 for p in self.pages.values() if p.state is state)
