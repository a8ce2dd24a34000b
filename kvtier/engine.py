"""The in-process tier engine: the public API over :class:`kvtier.core.EngineCore`.

See ``kvtier/ENGINE_API.md`` for every primitive's contract. In short: pools of GPU slots per
attached engine; pages that live on exactly one tier; ``acquire`` makes pages resident and pins
them (restores go first); ``release`` unpins; offload/prefetch are hints; content-keyed prefix
blocks are stored, looked up and loaded per tenant (``kvtier.prefix``). Every bad input raises a
``kvtier.errors`` class before any state changes; a capacity shortfall returns ``None``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.config import OffloadConfig
from kvtier.core import EngineCore
from kvtier.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, PageLost
from kvtier.events import Event, EventSubscription
from kvtier.pagetable import AcquireWait, Page
from kvtier.pool import Pool, Protected
from kvtier.prefix import PrefixStore
from kvtier.stats import EngineStats, TierStats
from kvtier.tiers.device import DevicePool
from kvtier.types import PageId, PageState, PoolId, SlotIndex, Tier
from kvtier.validate import check_ids, check_name, check_priority
from kvtier.watermark import Watermarks


@dataclass(slots=True, frozen=True)
class PageInfo:
    page_id: PageId
    state: PageState
    tier: Tier | None
    slot: int | None  # GPU slot while resident on the GPU
    pins: int


class TierEngine:
    """Thread-safe; every method may be called from any thread."""

    def __init__(self, config: OffloadConfig | None = None) -> None:
        self.config = config or OffloadConfig()
        self._core = EngineCore(self.config)
        self._pool_ids = itertools.count(1)
        self.prefix = PrefixStore(self._core)
        self._watermarks = Watermarks(self._core)

    @property
    def device(self) -> torch.device:
        return self._core.device

    # -- pools -------------------------------------------------------------------------------
    def attach(
        self,
        tenant: str,
        num_slots: int,
        page_size: int | None = None,
        *,
        default_priority: float = 1.0,
    ) -> Pool:
        """A daemon-allocated GPU pool; ``None`` budget shortfall raises nothing but returns."""
        check_name("tenant", tenant)
        check_priority("default_priority", default_priority)
        size = self.config.page_size if page_size is None else page_size
        if not isinstance(size, int) or size < 4096 or size % 4096 or size > 64 * 1024 * 1024:
            raise InvalidArgument(
                "page_size", f"must be a multiple of 4096 in [4096, 64MiB], got {size}"
            )
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise InvalidArgument("num_slots", f"must be a positive integer, got {num_slots}")
        with self._core.cond:
            self._core_open()
            used = sum(
                p.num_slots * p.page_size for p in self._core.pools.values() if not p.external
            )
            if used + num_slots * size > self.config.gpu_budget_bytes:
                from kvtier.errors import CapacityError

                raise CapacityError(
                    f"num_slots: {num_slots} x {size} B exceeds the GPU budget "
                    f"({self.config.gpu_budget_bytes - used} B free "
                    f"of {self.config.gpu_budget_bytes})"
                )
            dev = DevicePool.allocate(num_slots, size, str(self._core.device))
            return self._add_pool(tenant, dev, default_priority, external=False)

    def register(
        self, tenant: str, segments: list[torch.Tensor], *, default_priority: float = 1.0
    ) -> Pool:
        """Engine-owned memory (e.g. vLLM's KV tensors): the engine manages its slots."""
        check_name("tenant", tenant)
        check_priority("default_priority", default_priority)
        dev = DevicePool.from_segments(list(segments))
        with self._core.cond:
            self._core_open()
            return self._add_pool(tenant, dev, default_priority, external=True)

    def _add_pool(self, tenant: str, dev: DevicePool, prio: float, *, external: bool) -> Pool:
        pool = Pool(
            PoolId(next(self._pool_ids)), tenant, dev, self._core.new_policy(), prio, external
        )
        self._core.pools[pool.pool_id] = pool
        return pool

    def detach(self, pool_id: PoolId) -> None:
        with self._core.cond:
            pool = self._pool(pool_id)
            for page in self._core.table.of_pool(pool_id):
                self._free_page(page)
            while pool.moving_down or any(p.moving for p in self._core.table.of_pool(pool_id)):
                self._core.cond.wait(0.05)
            del self._core.pools[pool_id]
            pool.dev.close()

    def pool(self, pool_id: PoolId) -> Pool:
        with self._core.cond:
            return self._pool(pool_id)

    def pools(self, tenant: str | None = None) -> list[Pool]:
        with self._core.cond:
            return [p for p in self._core.pools.values() if tenant in (None, p.tenant)]

    def _pool(self, pool_id: PoolId) -> Pool:
        pool = self._core.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id} not found")
        return pool

    def _core_open(self) -> None:
        if self._core.closed:
            from kvtier.errors import Unavailable

            raise Unavailable("the engine is shut down")

    # -- pages -------------------------------------------------------------------------------
    def allocate(
        self,
        pool_id: PoolId,
        n: int,
        *,
        priority: float | None = None,
        sequence_length: int | None = None,
    ) -> list[tuple[PageId, SlotIndex]] | None:
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument("n", f"must be a positive integer, got {n}")
        if priority is not None:
            check_priority("priority", priority)
        if sequence_length is not None and (
            not isinstance(sequence_length, int) or sequence_length < n
        ):
            raise InvalidArgument("sequence_length", f"must be an integer >= n ({n})")
        deadline = time.monotonic() + self.config.restore_timeout_s
        core = self._core
        with core.cond:
            self._core_open()
            pool = self._pool(pool_id)
            if pool.external:
                raise FailedPrecondition(
                    f"pool {pool_id} is engine-managed (registered); allocate there"
                )
            if n > pool.num_slots - len(pool.pinned):
                return None
            while pool.dev.num_free < n:
                self._make_room(pool, n - pool.dev.num_free, set())
                if not self._wait(deadline):
                    return None
            slots = pool.dev.alloc(n)
            assert slots is not None
            out = []
            length = sequence_length or n
            for i, slot in enumerate(slots):
                page = Page(
                    core.table.new_id(),
                    pool_id,
                    pool.tenant,
                    pool.page_size,
                    PageState.GPU,
                    Tier.GPU,
                    slot,
                    priority=pool.default_priority if priority is None else priority,
                    position=i,
                    length=length,
                    pins=1,
                )
                core.table.add(page)
                core.settle(page, Tier.GPU, slot)
                pool.pinned.add(page.page_id)
                out.append((page.page_id, SlotIndex(slot)))
            return out

    def free(self, pool_id: PoolId, page_ids: Sequence[PageId]) -> None:
        with self._core.cond:
            pool = self._pool(pool_id)
            pages = [self._core.table.get(pool.pool_id, p) for p in check_ids("page_ids", page_ids)]
            for page in dict.fromkeys(pages):
                self._free_page(page)
            self._core.cond.notify_all()

    def _free_page(self, page: Page) -> None:
        core = self._core
        if page.moving and not core.cancel(page):
            page.doomed = True
            return
        core.release_page(page)
        core.events.publish(Event("freed", page.pool_id, page.page_id, None, None))

    def acquire(
        self, pool_id: PoolId, page_ids: Sequence[PageId], *, timeout: float | None = None
    ) -> list[SlotIndex] | None:
        """Resident + pinned, restores first. See ENGINE_API.md."""
        core = self._core
        start = time.monotonic()
        deadline = start + (self.config.restore_timeout_s if timeout is None else timeout)
        with core.cond:
            self._core_open()
            pool = self._pool(pool_id)
            pages = [core.table.get(pool_id, p) for p in check_ids("page_ids", page_ids)]
            unique = list(dict.fromkeys(pages))
            wanted = {p.page_id for p in unique}
            others = sum(1 for pid in pool.pinned if pid not in wanted)
            if len(unique) > pool.num_slots - others:
                return None
            wait = AcquireWait()
            counted = False
            core.protect(wanted)  # neither cascade may push these down meanwhile
            try:
                self._check_lost(unique)
                self._watch(pool, unique, wait)
                restored = wait.left > 0
                on_cpu = [p for p in unique if p.state is PageState.CPU]
                on_disk = [p for p in unique if p.state is PageState.DISK]
                for page in unique:
                    if page.state is PageState.MOVING_DOWN:
                        core.cancel(page)  # back on the GPU: its wait pins it
                if wait.left:
                    core.restore_waiters += 1
                    counted = True
                while wait.left:
                    if wait.lost:
                        raise PageLost(f"pages {wait.lost} were dropped and must be recomputed")
                    on_cpu += wait.on_cpu
                    on_disk += wait.on_disk
                    wait.on_cpu, wait.on_disk = [], []
                    if on_cpu or on_disk:
                        on_cpu, on_disk = self._start_up(pool, on_cpu, on_disk, wanted)
                    if not wait.left:  # a small restore runs inline and may be done already
                        break
                    if not self._wait(deadline):
                        raise DeadlineExceeded(f"acquire of {len(unique)} pages timed out")
            except BaseException:
                for page in wait.pinned:
                    self._unpin(pool, page)
                raise
            finally:
                if counted:
                    core.restore_waiters -= 1
                for page in unique:
                    if page.waits:
                        page.waits = [w for w in page.waits if w is not wait] or None
                core.unprotect(wanted)
            for page in unique:
                page.hits += 1
                pool.policy.touch(page.page_id)
            if restored:
                core.counters.restore_latencies.append(time.monotonic() - start)
                del core.counters.restore_latencies[:-4096]
            return [SlotIndex(p.slot) for p in pages]

    def try_acquire(self, tenant: str, pool_id: PoolId,
                    page_ids: Sequence[PageId]) -> list[SlotIndex] | None:
        """Non-blocking fast path for callers on an event loop.

        Pins and returns the slots only when the engine lock is free at once, the pool belongs to
        ``tenant`` and every page is resident on the GPU; otherwise returns ``None`` having
        changed nothing (the caller then uses :meth:`acquire`, which also reports errors).
        """
        core = self._core
        if not core.cond.acquire(blocking=False):
            return None
        try:
            pool = core.pools.get(pool_id)
            if core.closed or pool is None or pool.tenant != tenant:
                return None
            pages = []
            for pid in page_ids:
                page = core.table.pages.get(pid)
                if page is None or page.pool_id != pool_id or page.state is not PageState.GPU:
                    return None
                pages.append(page)
            for page in dict.fromkeys(pages):
                self._pin(pool, page)
                page.hits += 1
                pool.policy.touch(page.page_id)
            core.counters.hits[Tier.GPU] += 1
            return [SlotIndex(p.slot) for p in pages]
        finally:
            core.cond.release()

    def try_release(self, tenant: str, pool_id: PoolId, page_ids: Sequence[PageId]) -> bool:
        """Non-blocking :meth:`release`: True if done; False (nothing changed) if the lock was
        busy or any id is not an acquired page of ``tenant``'s pool."""
        core = self._core
        if not core.cond.acquire(blocking=False):
            return False
        try:
            pool = core.pools.get(pool_id)
            if pool is None or pool.tenant != tenant:
                return False
            pages = []
            for pid in dict.fromkeys(page_ids):
                page = core.table.pages.get(pid)
                if page is None or page.pool_id != pool_id or page.pins == 0:
                    return False
                pages.append(page)
            ready = self._record_ready()
            for page in pages:
                self._unpin(pool, page)
                page.ready = ready
            core.cond.notify_all()
            return True
        finally:
            core.cond.release()

    def _watch(self, pool: Pool, pages: list[Page], wait: AcquireWait) -> None:
        """Pin the resident pages now; register ``wait`` on the others."""
        per_tier = [0, 0, 0]
        gpu = PageState.GPU
        for page in pages:
            per_tier[page.tier] += 1
            if page.state is gpu:
                self._pin(pool, page)
                wait.pinned.append(page)
            else:
                if page.waits is None:
                    page.waits = [wait]
                else:
                    page.waits.append(wait)
                wait.left += 1
        hits = self._core.counters.hits
        for tier in Tier:
            hits[tier] += per_tier[tier]

    def _start_up(self, pool: Pool, on_cpu: list[Page], on_disk: list[Page],
                  wanted: set[PageId]) -> tuple[list[Page], list[Page]]:
        """Start the next leg toward the GPU; returns the pages still waiting for room."""
        core = self._core
        on_cpu = [p for p in on_cpu if p.state is PageState.CPU]
        on_disk = [p for p in on_disk if p.state is PageState.DISK]
        # GPU room first: the victims need CPU slots that disk restores would otherwise take.
        short = len(on_cpu) + len(on_disk) - pool.dev.num_free
        if short > 0:
            self._make_room(pool, short, wanted)
        started = core.restore_cpu(pool, on_cpu)
        if short <= 0:
            core.restore_disk(on_disk)
        return on_cpu[started:], [p for p in on_disk if p.state is PageState.DISK]

    def _make_room(self, pool: Pool, n: int, keep: set[PageId]) -> None:
        """Evict ``n`` GPU victims (urgently) unless enough slots are already on their way."""
        n -= pool.moving_down
        if n <= 0:
            return
        victims = pool.policy.evict(n, Protected(pool.pinned, keep))
        if victims is None:
            evictable = len(pool.policy) - len(pool.pinned)
            victims = (
                pool.policy.evict(evictable, Protected(pool.pinned, keep))
                if evictable > 0
                else None
            )
        pages = [self._core.table.pages[v] for v in victims or []]
        for page in pages:  # evict() stopped tracking them; settle bookkeeping expects them
            pool.policy.insert(page.meta())
        self._core.counters.evictions[Tier.GPU] += self._core.offload(pages, urgent=True)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no transfer is queued or in flight (True), or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self._core.cond:
            while True:
                if (
                    self._core.scheduler.depth() == (0, 0)
                    and self._core.scheduler.inflight_bytes == 0
                ):
                    return True
                if time.monotonic() > deadline:
                    return False
                # Short: the lanes count a batch out of flight just after they notify.
                self._core.cond.wait(0.0005)

    def _check_lost(self, pages: list[Page]) -> None:
        lost = [p.page_id for p in pages if p.state is PageState.DROPPED]
        if lost:
            raise PageLost(f"pages {lost} were dropped and must be recomputed")

    def _wait(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._core.cond.wait(min(remaining, 0.05))
        self._core_open()
        return True

    def _pin(self, pool: Pool, page: Page) -> None:
        page.pins += 1
        pool.pinned.add(page.page_id)

    def _unpin(self, pool: Pool, page: Page) -> None:
        page.pins -= 1
        if page.pins == 0:
            pool.pinned.discard(page.page_id)

    def release(self, pool_id: PoolId, page_ids: Sequence[PageId]) -> None:
        with self._core.cond:
            pool = self._pool(pool_id)
            pages = list(
                dict.fromkeys(
                    self._core.table.get(pool_id, p) for p in check_ids("page_ids", page_ids)
                )
            )
            bad = [p.page_id for p in pages if p.pins == 0]
            if bad:
                raise FailedPrecondition(f"page_ids: pages {bad} are not acquired")
            ready = self._record_ready()
            for page in pages:
                self._unpin(pool, page)
                page.ready = ready
            self._core.cond.notify_all()

    def _record_ready(self) -> object:
        if self._core.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._core.device))
        return event

    def offload(self, pool_id: PoolId, page_ids: Sequence[PageId]) -> int:
        with self._core.cond:
            self._core_open()
            self._pool(pool_id)
            pages = [self._core.table.get(pool_id, p) for p in check_ids("page_ids", page_ids)]
            return self._core.offload(list(dict.fromkeys(pages)))

    def prefetch(self, pool_id: PoolId, page_ids: Sequence[PageId]) -> int:
        with self._core.cond:
            self._core_open()
            pool = self._pool(pool_id)
            pages = list(
                dict.fromkeys(
                    self._core.table.get(pool_id, p) for p in check_ids("page_ids", page_ids)
                )
            )
            on_cpu = [p for p in pages if p.state is PageState.CPU][: pool.dev.num_free]
            on_disk = [p for p in pages if p.state is PageState.DISK]
            return self._core.restore_cpu(pool, on_cpu, urgent=False) + self._core.restore_disk(
                on_disk
            )

    def set_priority(self, pool_id: PoolId, page_ids: Sequence[PageId], priority: float) -> None:
        check_priority("priority", priority)
        with self._core.cond:
            self._pool(pool_id)
            pages = [self._core.table.get(pool_id, p) for p in check_ids("page_ids", page_ids)]
            for page in pages:
                page.priority = priority
                if not page.moving and page.state is not PageState.DROPPED:
                    self._core.policy_of(page).update(page.meta())

    def page_info(self, pool_id: PoolId, page_id: PageId) -> PageInfo:
        with self._core.cond:
            page = self._core.table.get(pool_id, page_id)
            tier = None if page.state is PageState.DROPPED else page.tier
            slot = page.slot if page.state is PageState.GPU else None
            return PageInfo(page.page_id, page.state, tier, slot, page.pins)

    def write(self, pool_id: PoolId, page_id: PageId, data: torch.Tensor) -> None:
        """Copy ``data`` (``page_size`` bytes, any dtype) into the page."""
        pool = self.pool(pool_id)
        flat = data.detach().reshape(-1).view(torch.uint8)
        if flat.numel() != pool.page_size:
            raise InvalidArgument("data", f"must be {pool.page_size} bytes, got {flat.numel()}")
        slots = self.acquire(pool_id, [page_id])
        if slots is None:
            raise FailedPrecondition(f"pool {pool_id} has no unpinned slot to write into")
        try:
            _scatter_row(pool, slots[0], flat)
        finally:
            self.release(pool_id, [page_id])

    def read(self, pool_id: PoolId, page_id: PageId) -> torch.Tensor:
        """A CPU copy of the page's bytes."""
        pool = self.pool(pool_id)
        slots = self.acquire(pool_id, [page_id])
        if slots is None:
            raise FailedPrecondition(f"pool {pool_id} has no unpinned slot to read into")
        try:
            return _gather_row(pool, slots[0]).cpu()
        finally:
            self.release(pool_id, [page_id])

    # -- prefix reuse (delegates) -----------------------------------------------------------------
    def store(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return self.prefix.store(pool_id, keys, slots)

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[Tier]:
        return self.prefix.lookup(tenant, keys)

    def load(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return self.prefix.load(pool_id, keys, slots)

    # -- operations -----------------------------------------------------------------------------
    def subscribe(self, maxsize: int = 1024) -> EventSubscription:
        return self._core.events.subscribe(maxsize)

    def stats(self) -> EngineStats:
        core = self._core
        with core.cond:
            gpu_cap = sum(p.num_slots * p.page_size for p in core.pools.values())
            gpu_used = sum(p.used_slots * p.page_size for p in core.pools.values())
            count = {t: 0 for t in Tier}
            for page in core.table.pages.values():
                if page.state in (PageState.GPU, PageState.CPU, PageState.DISK):
                    count[page.tier] += 1
            disk = core.disk
            restores, offloads = core.scheduler.depth()
            return EngineStats(
                tiers=(
                    TierStats(Tier.GPU, gpu_used, gpu_cap, count[Tier.GPU]),
                    TierStats(
                        Tier.CPU, core.host.used_bytes, core.host.capacity_bytes, count[Tier.CPU]
                    ),
                    TierStats(
                        Tier.DISK,
                        disk.used_bytes if disk else 0,
                        disk.capacity_bytes if disk else 0,
                        count[Tier.DISK],
                    ),
                ),
                pools=len(core.pools),
                tenants=len({p.tenant for p in core.pools.values()}),
                queued_restores=restores,
                queued_offloads=offloads,
                inflight_bytes=core.scheduler.inflight_bytes,
                pinned_pages=sum(len(p.pinned) for p in core.pools.values()),
                keyed_pages=len(core.table.by_key),
                counters=core.counters,
            )

    def close(self, grace: float = 10.0) -> None:
        """Stop accepting work, finish transfers in flight, persist the disk index."""
        core = self._core
        with core.cond:
            if core.closed:
                return
            core.closed = True
            core.cond.notify_all()
        self._watermarks.stop()
        core.scheduler.close(grace)
        core.inline_restore.close()
        with core.cond:
            for pool in list(core.pools.values()):
                pool.dev.close()
        if core.disk is not None:
            core.disk.close()
        core.host.close()
        core.events.close()

    def __enter__(self) -> TierEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gather_row(pool: Pool, slot: int) -> torch.Tensor:
    return torch.cat([seg[slot] for seg in pool.segments])


def _scatter_row(pool: Pool, slot: int, flat: torch.Tensor) -> None:
    off = 0
    for seg in pool.segments:
        width = seg.shape[1]
        seg[slot].copy_(flat[off : off + width])
        off += width


def configure_offload(config: OffloadConfig | None = None) -> TierEngine:
    """The documented entry point: an engine built from ``config`` (default: the environment)."""
    return TierEngine(config or OffloadConfig.from_env())
