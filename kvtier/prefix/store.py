"""Prefix reuse: content-keyed blocks stored, looked up and loaded per tenant.

Contract:
    * Keys are the engine's chained block hashes; inside the engine each key is salted with its
      tenant (``blake2b(key, key=H(tenant))``), so one tenant can't even name another's blocks and
      nothing is shared across tenants.
    * ``store`` copies pool slots into *keyed pages* that live in the CPU tier (and may cascade to
      disk like any page); a key already stored is counted as stored and not rewritten.
    * ``lookup`` returns the tier of each block of the longest stored prefix (stops at the first
      miss); ``load`` copies that prefix into the given slots, restoring disk blocks through CPU
      first, and returns how many leading blocks it loaded. A block whose bytes fail their checksum
      ends the prefix: a hit is exactly the stored bytes, or a miss.
    * With a remote tier (``prefix/remote.py``), stored blocks are also written behind to it (per
      its admission rule); ``lookup`` and ``load`` look there, outside the engine lock, past the end
      of the local prefix: a lookup answers ``Tier.REMOTE`` for those blocks, a load lands them
      in the CPU tier first (like a disk hit). A store fault is a local-only answer.
    * ``store`` and ``load`` with a ``caller`` (``kvtier/caller.py``) copy nothing more once it
      is gone (it may have reused its slots): the keys not stored (nor written behind), the
      blocks not loaded.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np

from kvtier.caller import Caller
from kvtier.core import EngineCore
from kvtier.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from kvtier.loan import PAUSE_S, LaneLoan
from kvtier.prefix.chunks import chunk_sizes
from kvtier.prefix.copies import Copies, done, succeeded
from kvtier.prefix.resident import Patience, resident
from kvtier.prefix.salt import Salted, salt_key, salt_keys
from kvtier.prefix.shared import Held, Staged, Stager, hold, land, offer, unstage
from kvtier.state.pool import Pool
from kvtier.state.table import EMPTY
from kvtier.transfer.base import Moves
from kvtier.types import Direction, PageState, PoolId, Tier
from kvtier.validate import check_keys, check_name, check_slots, unrepeated


class PrefixStore:
    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @property
    def core(self) -> EngineCore:
        return self._core

    def pool(self, pool_id: PoolId) -> Pool:
        if self._core.closed:
            raise Unavailable("the engine is shut down")
        pool = self._core.pools.get(pool_id)
        if pool is None or pool.detaching:
            raise NotFound(f"pool {pool_id} not found")
        return pool

    def args(
        self, pool: Pool, keys: Sequence[bytes], slots: Sequence[int]
    ) -> tuple[list[bytes], list[int]]:
        keys = check_keys("keys", keys)
        slots = check_slots("slots", slots, pool.num_slots)
        if len(keys) != len(slots):
            raise InvalidArgument(
                "slots", f"need one slot per key ({len(keys)} keys, {len(slots)} slots)"
            )
        if not pool.external and slots:
            rows = pool.slot_rows[np.array(slots, dtype=np.int64)]
            bad = (rows < 0) | (self._core.table.pins[np.maximum(rows, 0)] == 0)
            if bad.any():
                slot = slots[int(np.argmax(bad))]
                raise FailedPrecondition(
                    f"slots: slot {slot} holds no acquired page of pool {pool.pool_id}"
                )
        return keys, slots

    def store(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int],
              caller: Caller | None = None) -> int:
        core, caller = self._core, caller or Caller()
        with core.cond:
            pool = self.pool(pool_id)
            keys, slots = self.args(pool, keys, slots)
            stored, at, full = 0, 0, True
            started: list[Moves] = []  # each chunk's copies start before the next is hashed
            with self.lend(pool, Direction.GPU_TO_CPU) as loan:
                pending = Copies(pool, Direction.GPU_TO_CPU, loan, caller)
                for size in chunk_sizes(len(keys), pool.page_size, core.config.batch_bytes):
                    if caller.gone:
                        break
                    todo, busy = self._new_keys(pool, keys[at : at + size],
                                                slots[at : at + size])
                    stored += size - len(todo) - busy  # already stored (or earlier in this call)
                    at += size
                    full = self._store_chunk(pool, list(todo.items()), pending, started)
                    started += pending.submit(core)
                    if not full:
                        break
            self.wait(started)
            held: Held = []  # none for a caller gone: a copy under way then may hold new bytes
            if (core.remote is not None and core.remote.admission == "always"
                    and not caller.gone):
                held = hold(core, succeeded(pending.sent), fresh=True)
            stored += sum(r is True for b in started for r in b.results or ())
        offer(core, held)  # copies for the write-behind, without the engine lock
        return stored

    def forget(self, pool_id: PoolId, keys: Sequence[bytes]) -> int:
        """Drop ``keys`` of the pool's tenant (counted ``abandoned``), those in use (being loaded
        or moving) excepted; how many: what a Store whose caller gave up stored (a copy under
        way when it left may have read memory it reused since: a hit could be other bytes)."""
        core = self._core
        with core.cond:
            pool = core.pools.get(pool_id)
            if pool is None:
                return 0
            t = core.table
            found = [r for r in map(t.by_key.get, salt_keys(pool.tenant, list(keys)))
                     if r is not None]
            rows = np.unique(np.array(found, dtype=np.int64))
            rows = rows[t.settled(rows) & (t.protect[rows] == 0)]
            core.drop(rows, "abandoned")
            return len(rows)

    def _new_keys(
        self, pool: Pool, keys: list[bytes], slots: list[int]
    ) -> tuple[dict[bytes, int], int]:
        """Salted key -> slot of each key not stored yet at ``pool``'s page size (the first of
        repeats in ``keys``), and how many keys can't be stored now.

        A key stored only at another page size holds another layout's bytes, which a load at
        this size never returns: its page is replaced (dropped, counted ``replaced``), unless
        it is in use (being loaded, or moving), when the key is not stored by this call."""
        t = self._core.table
        salted = salt_keys(pool.tenant, keys)
        todo: dict[bytes, int] = {}
        other: dict[bytes, int] = {}  # key -> its row at another page size
        for key, slot, row in zip(salted, slots, map(t.by_key.get, salted), strict=True):
            if key in todo:
                continue
            if row is None:
                todo[key] = slot
            elif t.size[row] != pool.page_size:
                todo[key], other[key] = slot, row
        if not other:
            return todo, 0
        rows = np.fromiter(other.values(), dtype=np.int64, count=len(other))
        free = t.settled(rows) & (t.protect[rows] == 0)
        self._core.drop(rows[free], "replaced")
        for key in (k for k, ok in zip(other, free.tolist(), strict=True) if not ok):
            del todo[key]
        return todo, int((~free).sum())

    def _store_chunk(
        self, pool: Pool, items: list[tuple[bytes, int]], pending: Copies, started: list[Moves]
    ) -> bool:
        """New keyed pages for ``items`` (salted key, slot) with their copies added to
        ``pending``; False when the CPU tier could not take them all (the store ends there)."""
        by_key = self._core.table.by_key
        stale = False  # since a wait: every item left, not only the next part, is checked
        while items:
            got, waited = self._cpu_slots(pool, len(items), pending, started)
            if not len(got):
                return False
            part, items = items[: len(got)], items[len(got) :]
            stale = stale or waited
            if stale:  # a wait let other calls in: a key another store added meanwhile
                # (at any page size) is theirs; adding it again gave one key several pages
                fresh = [item for item in part if item[0] not in by_key]
                if len(fresh) < len(part):
                    self._core.free_slots(Tier.CPU, pool.page_size, got[len(fresh) :], None)
                    part, got = fresh, got[: len(fresh)]
            if part:
                rows = self._new_keyed(pool, [k for k, _ in part], got)
                pending.add(rows, np.array([s for _, s in part], dtype=np.int64), got)
        return True

    def _new_keyed(self, pool: Pool, keys: list[bytes], slots: np.ndarray) -> np.ndarray:
        """Keyed pages of ``pool``'s tenant, moving into CPU ``slots`` (a store in flight)."""
        t, ledger = self._core.table, self._core.ledger
        rows = t.add(len(keys), pool=0, size=pool.page_size, owner=ledger.owner(pool.tenant))
        t.mark_incoming(rows, Tier.CPU, slots)
        t.add_keys(rows, keys, pool.tenant)
        ledger.incoming[Tier.CPU] += ledger.per_owner(t.owner[rows], pool.page_size)
        return rows

    def _cpu_slots(self, pool: Pool, n: int, pending: Copies, started: list[Moves]
                   ) -> tuple[np.ndarray, bool]:
        """Up to ``n`` CPU slots for stored blocks, waiting (bounded) while the cascade frees
        some; and whether it waited (the engine lock was released meanwhile).

        A full CPU tier sends its victims to disk asynchronously: rather than storing fewer
        blocks than asked, wait for those writes while any transfer is still under way.
        """
        core = self._core
        deadline = time.monotonic() + core.config.restore_timeout_s
        owner = core.ledger.owner(pool.tenant)
        waited = False
        while True:
            got = core.cascade.cpu_slots(pool.page_size, n, owner)
            if len(got) or time.monotonic() > deadline:
                return got, waited
            # let the copies prepared so far start, so they can cascade
            started += pending.submit(core)
            restores, offloads = core.scheduler.depth()
            busy = restores or offloads or core.scheduler.inflight_bytes
            if not busy and all(done(b) for b in started):
                return got, waited  # nothing under way will free a slot
            if pending.loan is not None:
                pending.loan.give_back()  # the lane's own queue goes on while this waits
            core.cond.wait(0.01)
            waited = True

    def lend(self, pool: Pool, direction: Direction) -> LaneLoan:
        """``pool``'s lane on loan (``kvtier/loan.py``): pauses wait on the engine lock."""
        pause = functools.partial(self._core.cond.wait, PAUSE_S)
        return self._core.scheduler.lend(direction, pool.dev.device, pause)

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[Tier]:
        check_name("tenant", tenant)
        keys = check_keys("keys", keys)
        core = self._core
        t = core.table
        with core.cond:
            tiers: list[Tier] = []
            owner = core.ledger.find(tenant)
            for key in keys:
                row = t.keyed(salt_key(tenant, key))
                if row is None or t.page_state(row) is PageState.DROPPED:
                    break
                tier = core.wire[int(t.tier[row])]
                tiers.append(tier)
                core.counters.hits[tier] += 1
                core.ledger.hits[tier, owner] += 1
            if core.remote is None or len(tiers) == len(keys):
                self._count_misses(owner, len(keys) - len(tiers))
                return tiers
        rest = salt_keys(tenant, keys[len(tiers) :])
        tiers += [Tier.REMOTE] * core.remote.contains(rest)  # no engine lock held
        with core.cond:
            remote = sum(x is Tier.REMOTE for x in tiers)
            core.counters.hits[Tier.REMOTE] += remote
            core.ledger.hits[Tier.REMOTE, owner] += remote
            self._count_misses(owner, len(keys) - len(tiers))
        return tiers

    def _count_misses(self, owner: int, n: int) -> None:
        """A miss per block asked for and found nowhere, as a hit per block found."""
        if n:
            self._core.counters.misses += n
            self._core.ledger.misses[owner] += n

    def load(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int],
             caller: Caller | None = None) -> int:
        keys, slots = unrepeated(keys, slots)
        caller = caller or Caller()  # none given: one that waits
        loaded = self._load_once(pool_id, keys, slots, caller)
        # A remote fetch brings a bounded window past the local prefix: while a pass loads
        # something, the next one fetches on from where it stopped (a miss ends it).
        while self._core.remote is not None and 0 < loaded < len(keys):
            more = self._load_once(pool_id, keys[loaded:], slots[loaded:], caller)
            if not more:
                break
            loaded += more
        return loaded

    def _load_once(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int],
                   caller: Caller) -> int:
        core = self._core
        staged = self.fetch_remote(pool_id, keys, slots)  # in CPU slots, not yet pages
        reused: Held = []  # blocks reused for the first time: offered once the lock is released
        try:
            with core.cond:
                pool = self.pool(pool_id)
                keys, slots = self.args(pool, keys, slots)
                if staged is not None:
                    land(core, staged)
                    staged = None
                return self._load_windows(pool, keys, slots, reused, caller)
        finally:
            if staged is not None:
                with core.cond:
                    unstage(core, staged)
            offer(core, reused)

    def _load_windows(
        self, pool: Pool, keys: list[bytes], slots: list[int], reused: Held,
        caller: Caller,
    ) -> int:
        # A prefix longer than a window is brought up from disk and copied a window at a time.
        window = self.cpu_window(pool)
        loaded = 0
        while loaded < len(keys):
            part = keys[loaded : loaded + window]
            n = self._load_window(pool, part, slots[loaded : loaded + len(part)], reused, caller)
            loaded += n
            if n < len(part):
                break
        return loaded

    def cpu_window(self, pool: Pool) -> int:
        """Blocks of ``pool``'s size a load brings to the CPU tier at once: half the tier, and
        no more than the tenant's CPU quota holds."""
        core = self._core
        window = max(1, core.host.capacity_bytes // pool.page_size // 2)
        share = core.ledger.quota(pool.tenant).cpu if core.ledger.active else None
        return window if share is None else max(1, min(window, share // pool.page_size))

    def lendable(self, pool: Pool, salted: list[bytes]) -> np.ndarray:
        """Rows of the stored prefix of ``salted`` (lock held), up to (not past) the block that
        would bring more than ``cpu_window`` blocks up from below the CPU tier: blocks already
        there need no room in it."""
        stored = self.prefix(pool, salted)
        below = np.cumsum(~self._core.table.at(stored, Tier.CPU))
        return stored[: int(np.searchsorted(below, self.cpu_window(pool), side="right"))]

    def _load_window(
        self, pool: Pool, keys: list[bytes], slots: list[int], reused: Held,
        caller: Caller,
    ) -> int:
        """Copy the stored prefix of ``keys`` (a window: all of it protected until copied) a
        chunk at a time, each chunk's copies under way while the next chunk's keys are looked
        up; the number of leading blocks loaded."""
        core = self._core
        held: list[np.ndarray] = []
        batches: list[Moves] = []
        at = 0
        salted = Salted(pool.tenant, keys)
        sizes = chunk_sizes(len(keys), pool.page_size, core.config.batch_bytes)
        deep = False  # every disk read of the window queued
        try:
            with self.lend(pool, Direction.CPU_TO_GPU) as loan:
                for i, size in enumerate(sizes):
                    if caller.gone:
                        break
                    rows = self.resident_prefix(pool, salted.span(at, at + size), loan,
                                                caller.patience)
                    held.append(rows)
                    batches += self._copy_in(pool, rows, slots[at : at + len(rows)], loan,
                                             caller)
                    at += len(rows)
                    if len(rows) < size:
                        break
                    # This chunk's copies are under way: queue the next chunk's disk reads,
                    # and if it has any, the whole rest's at once.
                    if not deep and i + 1 < len(sizes):
                        deep = self._read_ahead(pool, salted.span(at, at + sizes[i + 1]))
                        if deep:
                            self._read_ahead(pool, salted.span(at, len(keys)))
            self.wait(batches)
        finally:
            for rows in held:
                core.unprotect(rows)
        if at:
            reused += self.reused(pool, np.concatenate(held))
        results = [r for b in batches for r in b.results or ()]
        return results.index(False) if False in results else len(results)

    def reused(self, pool: Pool, rows: np.ndarray) -> Held:
        """Loaded rows (lock held): touched in the CPU policy, hit counted; the ones the remote
        tier admits on first reuse, held for ``offer`` once the lock is released."""
        core = self._core
        core.policy_of(Tier.CPU, None, pool.page_size).touch(rows)
        held: Held = []
        if core.remote is not None and core.remote.admission == "reused":
            held = hold(core, rows[core.table.hits[rows] == 0])  # first reuse
        core.table.hit(rows)
        return held

    def fetch_remote(
        self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int]
    ) -> Staged | None:
        """Verified remote payloads of the blocks just past the local prefix (a CPU window of
        them, ``cpu_window``: within the tenant's CPU quota), fetched and staged in CPU slots
        without the engine lock; None without a remote tier or remote hits."""
        core = self._core
        if core.remote is None:
            return None
        with core.cond:
            pool = self.pool(pool_id)
            keys, slots = self.args(pool, keys, slots)
            every = salt_keys(pool.tenant, keys)
            start = len(self.prefix(pool, every))
            salted = every[start : start + self.cpu_window(pool)]
            owner = core.ledger.owner(pool.tenant)  # the staged slots are the tenant's
        if not salted:
            return None
        stager = Stager(core, pool.tenant, owner, pool.page_size)  # copies each batch as it arrives
        core.remote.fetch_each(salted, pool.page_size, stager.take)
        return stager.staged(salted)

    def _copy_in(
        self, pool: Pool, rows: np.ndarray, slots: list[int], loan: LaneLoan | None = None,
        caller: Caller | None = None,
    ) -> list[Moves]:
        """Start copying CPU-resident keyed pages into pool slots (urgent: a load waits)."""
        if not len(rows):
            return []
        copies = Copies(pool, Direction.CPU_TO_GPU, loan, caller)
        copies.add(rows, self._core.table.slot[rows], np.array(slots, dtype=np.int64))
        return copies.submit(self._core, urgent=True)

    def resident_prefix(
        self, pool: Pool, salted: list[bytes], loan: LaneLoan | None = None,
        patience: Patience | None = None,
    ) -> np.ndarray:
        """Rows of the longest stored prefix of ``salted``, brought to the CPU tier and returned
        protected (``kvtier/prefix/resident.py``: a leading part when the rest can't come, or
        by ``patience`` does not pay to wait for)."""
        return resident(self._core, self.prefix, pool, salted, loan, patience)

    def _read_ahead(self, pool: Pool, salted: list[bytes]) -> bool:
        """Queue the disk reads of every stored block of ``salted`` at once, so the disk lane
        reads the next chunks while the previous one is copied on (the chunks then only wait);
        whether there were any."""
        rows = self.prefix(pool, salted)
        on_disk = rows[self._core.table.below_cpu(rows)]
        if len(on_disk):
            self._core.starts.restore_below(on_disk)
        return bool(len(on_disk))

    def prefix(self, pool: Pool, salted: list[bytes]) -> np.ndarray:
        """Rows of the longest prefix of ``salted`` stored (not dropped) at ``pool``'s size.
        ``salted`` repeats no key (``unrepeated`` at every entry: one restore, one protect, one
        copy source per page)."""
        t = self._core.table
        found = list(map(t.by_key.get, salted))
        if None in found:
            found = found[: found.index(None)]
        rows = np.array(found, dtype=np.int64) if found else EMPTY
        bad = t.dropped(rows) | (t.size[rows] != pool.page_size)
        return rows[: int(np.argmax(bad))] if bad.any() else rows

    def wait(self, batches: list[Moves]) -> None:
        deadline = time.monotonic() + self._core.config.restore_timeout_s
        while not all(done(b) for b in batches):
            if time.monotonic() > deadline:
                raise DeadlineExceeded("copy of stored blocks timed out")
            self._core.cond.wait(0.05)

