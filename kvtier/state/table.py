"""The page table: the one place where page state lives, as numpy columns (one row per page).

Contract:
    * A page is a *row*: a dense integer index into every column. Its public id is
      ``generation << 32 | row``; a row is reused after its page is removed, with the next
      generation, so a stale id never names the new page (``NotFound``).
    * Every live row is in exactly one state: settled in a tier, moving down, moving up, or
      dropped (``PageState`` names them; the codes are private to this module). ``tier``/``slot``
      say where its bytes are (while moving: the source, which stays valid until the move
      completes).
    * This class is the only writer of its columns: every change of a page is one of the verbs
      below (``add``, ``settle``, ``mark_moving``, ``mark_incoming``, ``mark_dropped``,
      ``doom``, ``pin``/``unpin``, ``await_landing``/``withdraw_wait``/``land``,
      ``guard``/``unguard``, ``hit``, ``set_priority``, ``set_ready``, ``remove``); other
      modules read the columns and ask the queries (``at``, ``below_cpu``, ``settled``, ``moving``,
      ``moving_down``, ``moving_up``, ``dropped``, ``page_state``, ``tier_counts``).
    * ``pins`` > 0 means an engine is using the page on the GPU: it never moves or is evicted.
      ``waiting`` counts acquires waiting for the page to reach the GPU: the completion that lands
      it there turns them into pins at once (``land``); no cascade pushes such a page down.
      ``protect`` counts loads that need the page kept where it is (no cascade or eviction
      takes it).
    * A row with ``pool == 0`` is a *keyed* page (a stored prefix block) owned by a tenant; keyed
      pages live in the CPU and disk tiers only and carry a (salted) content key.
    * ``owner`` is the page's tenant (an id of ``kvtier.tenancy.quotas.TenantLedger``), set when the
      row is created and never changed: the per-tenant byte counts follow it.
    * Callers pass rows as int64 arrays of *distinct* rows (``unique`` makes them so); every
      operation is one numpy pass per column, never a Python loop per page.
    * The table is not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import NotFound
from kvtier.tiers.runs import strictly_ascending
from kvtier.types import BELOW_CPU, PageId, PageState, PoolId

# State codes, private: a page settled in tier ``k`` (any tier of the chain) has code
# ``_S_HOME + k``, so "settled in tier k" and "settled anywhere" are one comparison each.
_S_NONE, _S_DOWN, _S_UP, _S_DROPPED = range(4)
_S_HOME = 8
_MOVING_NAMES = {_S_DOWN: PageState.MOVING_DOWN, _S_UP: PageState.MOVING_UP,
                 _S_DROPPED: PageState.DROPPED}
_HOME_NAMES = (PageState.GPU, PageState.CPU)  # by level; every level below the CPU: DISK
ROW_BITS = 32
ROW_MASK = (1 << ROW_BITS) - 1
EMPTY = np.empty(0, dtype=np.int64)

# name -> dtype of every column; ``move`` numbers the Moves batch a moving row was prepared in
# (0: none; ``BulkMoves.batch`` finds it while it is queued).
_COLUMNS: dict[str, Any] = {
    "state": np.int8,
    "tier": np.int8,
    "slot": np.int64,
    "pool": np.int64,
    "size": np.int64,
    "prio": np.float64,
    "pos": np.int64,
    "length": np.int64,
    "pins": np.int32,
    "waiting": np.int32,
    "protect": np.int32,
    "hits": np.int64,
    "doomed": np.bool_,
    "ready": np.int64,
    "gen": np.int64,
    "move": np.int64,
    "owner": np.int64,
}


class PageTable:
    """Pages as rows of numpy columns, plus keyed pages by (salted) content key."""

    state: np.ndarray
    tier: np.ndarray
    slot: np.ndarray
    pool: np.ndarray
    size: np.ndarray
    prio: np.ndarray
    pos: np.ndarray
    length: np.ndarray
    pins: np.ndarray
    waiting: np.ndarray
    protect: np.ndarray
    hits: np.ndarray
    doomed: np.ndarray
    ready: np.ndarray
    gen: np.ndarray
    move: np.ndarray
    owner: np.ndarray  # the tenant's id in the core's ``TenantLedger`` (0: none)

    def __init__(self, capacity: int = 1024) -> None:
        for name, dtype in _COLUMNS.items():
            setattr(self, name, _column(capacity, dtype))
        self._mark = np.zeros(capacity, dtype=np.int64)  # scratch for ``unique``
        self._high = 1  # rows below this have been used; row 0 is never a page
        self._free = np.empty(0, dtype=np.int64)  # removed rows, reused first
        self.live = 0
        self.removals = 0  # rows removed so far: unchanged means no id went stale meanwhile
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.tenant_of: dict[int, str] = {}

    # -- rows and ids ------------------------------------------------------------------------
    def new_rows(self, n: int) -> np.ndarray:
        """``n`` fresh rows (state no page, every column zero but ``gen``)."""
        reuse = self._free[-n:] if n else EMPTY
        self._free = self._free[: len(self._free) - len(reuse)]
        fresh = n - len(reuse)
        if self._high + fresh > len(self.state):
            self._grow(self._high + fresh)
        rows = np.concatenate([reuse, np.arange(self._high, self._high + fresh, dtype=np.int64)])
        self._high += fresh
        self.live += n
        return rows

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * len(self.state))
        for name in (*_COLUMNS, "_mark"):
            old = getattr(self, name)
            new = _column(cap, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def ids(self, rows: np.ndarray) -> np.ndarray:
        return (self.gen[rows] << ROW_BITS) | rows

    def ids_text(self, rows: np.ndarray, most: int = 8, gens: np.ndarray | None = None) -> str:
        """Page ids for an error message: all of them up to ``most``, else the first ``most``
        and how many more (a 65,536-page call must not raise a megabyte of ids). ``gens``:
        the generations the ids had (rows removed since have a new one)."""
        head = rows[:most]
        shown = (self.ids(head) if gens is None else (gens[:most] << ROW_BITS) | head).tolist()
        more = len(rows) - len(shown)
        return f"{shown}" if not more else f"{str(shown)[:-1]}, ... and {more} more]"

    def id_of(self, row: int) -> PageId:
        return PageId(int(self.gen[row]) << ROW_BITS | int(row))

    def rows(self, pool_id: PoolId, page_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of ``pool_id``'s pages, in order; ``NotFound`` naming the first bad id (an
        unknown or stale id, or a page of another pool)."""
        try:
            ids = np.asarray(page_ids, dtype=np.int64)
        except OverflowError:
            bad = next(i for i in page_ids if i >= 1 << 63)
            raise NotFound(f"page {bad} not found in pool {pool_id}") from None
        rows = ids & ROW_MASK
        if not len(rows):
            return rows
        # A removed row has pool 0 (never a pool's id) and a new generation: no state check.
        # Row 0 and rows never used have pool 0 too, so only the top needs a bound.
        inside = pool_id > 0 and int(rows.max()) < self._high
        if inside and ((self.gen[rows] == ids >> ROW_BITS) & (self.pool[rows] == pool_id)).all():
            return rows
        raise NotFound(f"page {self._first_bad(pool_id, ids)} not found in pool {pool_id}")

    def _first_bad(self, pool_id: PoolId, ids: np.ndarray) -> int:
        rows = ids & ROW_MASK
        ok = (rows > 0) & (rows < self._high) & (pool_id > 0)
        ok[ok] = (self.gen[rows[ok]] == ids[ok] >> ROW_BITS) & (self.pool[rows[ok]] == pool_id)
        return int(ids[np.argmin(ok)])

    def row(self, pool_id: PoolId, page_id: int) -> int:
        return int(self.rows(pool_id, [page_id])[0])

    def unique(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` without repeats (first occurrences, in order); ``rows`` itself when it has
        none (the common case: one pass for ascending rows, else three, no sort)."""
        n = len(rows)
        if strictly_ascending(rows):
            return rows
        order = np.arange(n, dtype=np.int64)
        self._mark[rows[::-1]] = order[::-1]  # the first occurrence's position wins
        first = self._mark[rows] == order
        return rows if first.all() else rows[first]

    def remove(self, rows: np.ndarray) -> None:
        """Forget pages (their slots must already be free): the rows go back for reuse."""
        if not len(rows):
            return
        self.state[rows] = _S_NONE
        self.gen[rows] += 1
        self.removals += len(rows)
        for name in ("pool", "pins", "waiting", "protect", "hits", "ready", "owner"):
            getattr(self, name)[rows] = 0
        self.doomed[rows] = False
        self.move[rows] = 0
        self.slot[rows] = -1
        if self.key_of:
            for row in rows.tolist():
                key = self.key_of.pop(row, None)
                if key is not None:
                    self.tenant_of.pop(row, None)
                    if self.by_key.get(key) == row:
                        del self.by_key[key]
        self._free = np.concatenate([self._free, rows])
        self.live -= len(rows)

    # -- the lifecycle: every write of a column is one of these ---------------------------------
    def add(
        self,
        n: int,
        *,
        pool: int,
        size: int,
        prio: float = 1.0,
        length: int = 1,
        owner: int = 0,
        positions: bool = False,
    ) -> np.ndarray:
        """``n`` new pages (no state yet: ``settle``/``mark_incoming`` gives them one) of
        ``pool`` (0: keyed) and ``owner``; ``positions``: numbered 0.. in their sequence."""
        rows = self.new_rows(n)
        self.pool[rows], self.size[rows], self.prio[rows], self.length[rows] = (
            pool, size, prio, length)
        if positions:
            self.pos[rows] = np.arange(n)
        self.owner[rows] = owner
        return rows

    def settle(self, rows: np.ndarray, tier: int, slots: np.ndarray) -> None:
        """``tier`` (a level of the chain, ``kvtier.types.BELOW_CPU``) and ``slots`` are the
        pages' home; any move of theirs has ended."""
        self.state[rows], self.tier[rows], self.slot[rows] = _S_HOME + tier, tier, slots
        self.move[rows] = 0

    def mark_moving(self, rows: np.ndarray, up: bool, batch: int) -> None:
        """Settled pages start a move (their source stays theirs) in the batch numbered
        ``batch``: toward the GPU (``up``) or away from it."""
        self.move[rows] = batch
        self.state[rows] = _S_UP if up else _S_DOWN

    def mark_incoming(self, rows: np.ndarray, tier: int, slots: np.ndarray) -> None:
        """New pages whose bytes are being copied into ``tier``/``slots`` (a store in flight):
        moving down, not yet readable; ``settle`` ends it, ``remove`` forgets a failed one."""
        self.state[rows], self.tier[rows], self.slot[rows] = _S_DOWN, tier, slots

    def mark_dropped(self, rows: np.ndarray) -> None:
        """The pages' bytes are gone (their slots already freed): reads raise ``PageLost``."""
        self.state[rows], self.slot[rows] = _S_DROPPED, -1

    def doom(self, rows: np.ndarray) -> None:
        """Moving pages freed meanwhile: removed when their move ends."""
        self.doomed[rows] = True

    def set_priority(self, rows: np.ndarray, priority: float) -> None:
        self.prio[rows] = priority

    def set_ready(self, rows: np.ndarray, ready: int) -> None:
        """The ready-event number the pages' last GPU use recorded (a copy waits for it)."""
        self.ready[rows] = ready

    def pin(self, rows: np.ndarray, times: np.ndarray | int = 1) -> int:
        """Pins added (distinct rows); returns how many pages were unpinned before."""
        newly = int(np.count_nonzero(self.pins[rows] == 0))
        self.pins[rows] += times
        return newly

    def unpin(self, rows: np.ndarray) -> int:
        """A pin less each (distinct pinned rows); returns how many are unpinned now."""
        self.pins[rows] -= 1
        return int(np.count_nonzero(self.pins[rows] == 0))

    def await_landing(self, rows: np.ndarray) -> None:
        """An acquire waits for these pages to land on the GPU (``land`` pins them for it)."""
        self.waiting[rows] += 1

    def withdraw_wait(self, rows: np.ndarray) -> None:
        """An acquire that gave up no longer waits for these (distinct, waited-for) pages."""
        self.waiting[rows] -= 1

    def land(self, rows: np.ndarray) -> np.ndarray:
        """Pages that just reached the GPU: every waiting acquire's wait becomes a pin and a
        hit. Returns the rows that had waiters (pinned now; they carried no pins before: a
        pinned page never moves)."""
        waiting = self.waiting[rows]
        if not waiting.all():  # counts are >= 0: all() is "every page is waited for"
            some = np.flatnonzero(waiting)
            if not len(some):
                return rows[:0]
            rows, waiting = rows[some], waiting[some]
        self.pins[rows] = waiting
        self.waiting[rows] = 0
        self.hits[rows] += waiting
        return rows

    def guard(self, rows: np.ndarray) -> None:
        """A load needs these pages where they are: no cascade or eviction takes them."""
        self.protect[rows] += 1

    def unguard(self, rows: np.ndarray) -> None:
        """Distinct rows; a row removed meanwhile has ``protect`` 0 and stays so."""
        self.protect[rows] = np.maximum(self.protect[rows] - 1, 0)

    def hit(self, rows: np.ndarray, times: np.ndarray | int = 1) -> None:
        self.hits[rows] += times

    # -- views ---------------------------------------------------------------------------------
    def page_state(self, row: int) -> PageState:
        code = int(self.state[row])
        assert code != _S_NONE, f"row {row} holds no page"
        if code >= _S_HOME:
            level = code - _S_HOME
            return _HOME_NAMES[level] if level < BELOW_CPU else PageState.DISK
        return _MOVING_NAMES[code]

    def keyed(self, key: bytes) -> int | None:
        return self.by_key.get(key)

    def add_key(self, row: int, key: bytes, tenant: str) -> None:
        self.by_key[key] = row
        self.key_of[row] = key
        self.tenant_of[row] = tenant

    def add_keys(self, rows: np.ndarray, keys: list[bytes], tenant: str) -> None:
        """``add_key`` of each row with its key, all of one tenant."""
        ids = rows.tolist()
        self.by_key.update(zip(keys, ids, strict=True))
        self.key_of.update(zip(ids, keys, strict=True))
        self.tenant_of.update(dict.fromkeys(ids, tenant))

    def of_pool(self, pool_id: PoolId) -> np.ndarray:
        live = self.state[: self._high] != _S_NONE
        return np.flatnonzero(live & (self.pool[: self._high] == pool_id)).astype(np.int64)

    def at(self, rows: np.ndarray, tier: int) -> np.ndarray:
        """Mask: settled in ``tier`` (a level of the chain)."""
        return self.state[rows] == _S_HOME + tier

    def below_cpu(self, rows: np.ndarray) -> np.ndarray:
        """Mask: settled in a medium below the CPU (any level from ``BELOW_CPU`` on)."""
        return self.state[rows] >= _S_HOME + BELOW_CPU

    def settled(self, rows: np.ndarray) -> np.ndarray:
        """Mask: settled in some tier (not moving, not dropped)."""
        return self.state[rows] >= _S_HOME

    def moving(self, rows: np.ndarray) -> np.ndarray:
        states = self.state[rows]
        return (states == _S_DOWN) | (states == _S_UP)

    def moving_down(self, rows: np.ndarray) -> np.ndarray:
        return self.state[rows] == _S_DOWN

    def moving_up(self, rows: np.ndarray) -> np.ndarray:
        return self.state[rows] == _S_UP

    def dropped(self, rows: np.ndarray) -> np.ndarray:
        return self.state[rows] == _S_DROPPED

    def settled_in_slots(self, tier: int, size: int, lo: int, hi: int) -> np.ndarray:
        """Rows of ``size`` settled in ``tier`` whose slot is in ``[lo, hi)``."""
        h = self._high
        hit = (self.state[:h] == _S_HOME + tier) & (self.size[:h] == size)
        hit &= (self.slot[:h] >= lo) & (self.slot[:h] < hi)
        return np.flatnonzero(hit).astype(np.int64)

    def live_rows(self) -> np.ndarray:
        """Every row holding a page."""
        return np.flatnonzero(self.state[: self._high] != _S_NONE).astype(np.int64)

    def tier_counts(self, rows: np.ndarray | None = None, tiers: int = 3) -> np.ndarray:
        """Pages settled in each of the first ``tiers`` levels (GPU, CPU, the media below),
        of ``rows`` or of the whole table; the last counts every level from it on (``tiers=3``:
        per wire tier, every medium below the CPU as DISK)."""
        states = self.state[: self._high] if rows is None else self.state[rows]
        home = states[states >= _S_HOME].astype(np.int64) - _S_HOME
        return np.bincount(np.minimum(home, tiers - 1), minlength=tiers)[:tiers]


def _column(n: int, dtype: Any) -> np.ndarray:
    if np.dtype(dtype) == np.dtype(object):
        return np.full(n, None, dtype=object)
    return np.zeros(n, dtype=dtype)


def by_value(values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Positions of ``values`` grouped by value, in first-seen order (one group when all equal,
    the common case: one comparison pass)."""
    if not len(values):
        return []
    first = values[0]
    if (values == first).all():
        return [(int(first), np.arange(len(values)))]
    uniq, index = np.unique(values, return_index=True)
    out = []
    for i in np.argsort(index):
        out.append((int(uniq[i]), np.flatnonzero(values == uniq[i])))
    return out
