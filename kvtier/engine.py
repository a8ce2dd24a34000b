"""The in-process tier engine: the public API over :class:`kvtier.core.EngineCore`.

See ``kvtier/ENGINE_API.md`` for every primitive's contract. In short: pools of GPU slots per
attached engine; pages that live on exactly one tier; ``acquire`` makes pages resident and pins
them (restores go first); ``release`` unpins; offload/prefetch are hints; content-keyed prefix
blocks are stored, looked up and loaded per tenant (``kvtier.prefix``). Every bad input raises
a ``kvtier.errors`` class before any state changes; a capacity shortfall returns ``None``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from kvtier.caller import Caller
from kvtier.config import OffloadConfig
from kvtier.core import EngineCore
from kvtier.errors import CapacityError, FailedPrecondition, InvalidArgument
from kvtier.pages.access import Residency
from kvtier.pages.watermark import Watermarks
from kvtier.prefix.borrow import Borrowed, borrow
from kvtier.prefix.flush import flush_keyed
from kvtier.prefix.layers import load_layers
from kvtier.prefix.remote import open_remote
from kvtier.prefix.store import PrefixStore
from kvtier.state.events import Event, EventSubscription
from kvtier.state.pool import Pool
from kvtier.stats import EngineStats, LatencyHistogram, TierStats
from kvtier.tenancy.views import admit_pool, tenant_stats
from kvtier.tiers.device import DevicePool
from kvtier.tiers.keyed import KeyedMedium
from kvtier.transfer.gather import page, put_page
from kvtier.types import PageId, PageState, PoolId, SlotIndex, Tier
from kvtier.validate import check_ids, check_name, check_priority

FLUSH_SHARE = 0.8  # of the close grace, for writing keyed CPU-tier pages to disk


@dataclass(slots=True, frozen=True)
class PageInfo:
    page_id: PageId
    state: PageState
    tier: Tier | None
    slot: int | None  # GPU slot while resident on the GPU
    pins: int


class TierEngine:
    """Thread-safe; every method may be called from any thread."""

    def __init__(
        self, config: OffloadConfig | None = None, *, remote_medium: KeyedMedium | None = None
    ) -> None:
        """``remote_medium`` replaces the Redis medium that ``config.remote_url`` would open."""
        self.config = config or OffloadConfig()
        remote = open_remote(self.config, remote_medium)  # a bad secret fails before threads start
        self._core = EngineCore(self.config)
        self._core.remote = remote
        self._pool_ids = itertools.count(1)
        self.prefix = PrefixStore(self._core)
        self._residency = Residency(self._core)
        self._watermarks = Watermarks(self._core)

    @property
    def device(self) -> torch.device:
        """The default device (the first of ``devices``)."""
        return self._core.device

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device this engine serves pools on, the default first."""
        return tuple(str(d) for d in self._core.devices)

    def _device_named(self, device: str | None) -> str:
        """``device`` if this engine serves it (None or empty: the default), else
        ``InvalidArgument`` naming the field."""
        served = self.devices
        if not device:
            return served[0]
        if device not in served:
            listed = ", ".join(served)
            raise InvalidArgument("device", f"this daemon serves {listed}, got {device!r}")
        return device

    # -- pools -------------------------------------------------------------------------------
    def attach(
        self,
        tenant: str,
        num_slots: int,
        page_size: int | None = None,
        *,
        default_priority: float = 1.0,
        device: str | None = None,
    ) -> Pool:
        """A daemon-allocated GPU pool on ``device`` (one of ``devices``; None: the default);
        ``None`` budget shortfall raises nothing but returns."""
        check_name("tenant", tenant)
        check_priority("default_priority", default_priority)
        where = self._device_named(device)
        size = self.config.page_size if page_size is None else page_size
        if not isinstance(size, int) or size < 4096 or size % 4096 or size > 64 * 1024 * 1024:
            raise InvalidArgument(
                "page_size", f"must be a multiple of 4096 in [4096, 64MiB], got {size}"
            )
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise InvalidArgument("num_slots", f"must be a positive integer, got {num_slots}")
        with self._core.cond:
            self._core_open()
            admit_pool(self._core, tenant, num_slots * size, external=False, slots=num_slots)
            dev = DevicePool.allocate(num_slots, size, where)
            return self._add_pool(tenant, dev, default_priority, external=False)

    def register(
        self, tenant: str, segments: list[torch.Tensor], *, default_priority: float = 1.0
    ) -> Pool:
        """Engine-owned memory (e.g. vLLM's KV tensors, on one of ``devices``): the engine
        manages its slots."""
        check_name("tenant", tenant)
        check_priority("default_priority", default_priority)
        dev = DevicePool.from_segments(list(segments))
        if dev.device not in self.devices:
            dev.close()
            raise InvalidArgument(
                "segments", f"on {dev.device}; this daemon serves {', '.join(self.devices)}"
            )
        with self._core.cond:
            self._core_open()
            try:
                admit_pool(self._core, tenant, dev.num_slots * dev.page_size, external=True,
                           slots=dev.num_slots, mappings=dev.mappings, mapped=dev.mapped_bytes)
            except CapacityError:
                dev.close()
                raise
            return self._add_pool(tenant, dev, default_priority, external=True)

    def _add_pool(self, tenant: str, dev: DevicePool, prio: float, *, external: bool) -> Pool:
        pool = Pool(
            PoolId(next(self._pool_ids)), tenant, dev, self._core.new_policy(), prio, external
        )
        self._core.pools[pool.pool_id] = pool
        return pool

    def detach(self, pool_id: PoolId) -> None:
        core = self._core
        with core.cond:
            pool = self._pool(pool_id)
            pool.detaching = True  # no new store or load through it (NotFound)
            self._free_rows(core.table.of_pool(pool_id))
            # Its pages' moves and the keyed copies through its memory end before it is closed.
            while pool.moving_down or len(core.table.of_pool(pool_id)) or pool.dev.copying:
                core.cond.wait(0.05)
            del core.pools[pool_id]
            pool.dev.close()

    def pool(self, pool_id: PoolId) -> Pool:
        with self._core.cond:
            return self._pool(pool_id)

    def pools(self, tenant: str | None = None) -> list[Pool]:
        with self._core.cond:
            return [p for p in self._core.pools.values() if tenant in (None, p.tenant)]

    def _pool(self, pool_id: PoolId) -> Pool:
        return self._core.pool_of(pool_id)

    def _core_open(self) -> None:
        self._core.check_open()

    # -- residency (kvtier/pages/access.py) --------------------------------------------------------
    def allocate(
        self,
        pool_id: PoolId,
        n: int,
        *,
        priority: float | None = None,
        sequence_length: int | None = None,
    ) -> list[tuple[PageId, SlotIndex]] | None:
        return self._residency.allocate(
            pool_id, n, priority=priority, sequence_length=sequence_length
        )

    @overload
    def acquire(
        self, pool_id: PoolId, page_ids: np.ndarray, *, timeout: float | None = None
    ) -> np.ndarray | None: ...
    @overload
    def acquire(
        self, pool_id: PoolId, page_ids: Sequence[PageId], *, timeout: float | None = None
    ) -> list[SlotIndex] | None: ...
    def acquire(
        self,
        pool_id: PoolId,
        page_ids: Sequence[PageId] | np.ndarray,
        *,
        timeout: float | None = None,
    ) -> list[SlotIndex] | np.ndarray | None:
        """Resident + pinned, restores first; an array of ids gives an ``int64`` array of slots
        (the fast form for large calls). See ENGINE_API.md."""
        return self._residency.acquire(pool_id, page_ids, timeout=timeout)

    def try_acquire(
        self, tenant: str, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray
    ) -> list[SlotIndex] | None:
        return self._residency.try_acquire(tenant, pool_id, page_ids)

    def release(self, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray) -> None:
        self._residency.release(pool_id, page_ids)

    def try_release(
        self, tenant: str, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray
    ) -> bool:
        return self._residency.try_release(tenant, pool_id, page_ids)

    # -- pages -------------------------------------------------------------------------------
    def free(self, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray) -> None:
        core = self._core
        ids = check_ids("page_ids", page_ids)
        with core.cond:
            self._pool(pool_id)
            self._free_rows(core.table.unique(core.table.rows(pool_id, ids)))
            core.cond.notify_all()

    def _free_rows(self, rows: np.ndarray) -> None:
        """Free pages: settled ones at once, moving ones by cancelling their move or, once it is
        under way, when it completes (``doomed``)."""
        core, t = self._core, self._core.table
        going = rows[t.moving(rows)]
        if len(going):
            core.cancel(going)
            t.doom(going[t.moving(going)])  # under way: at its end
        rows = rows[~t.doomed[rows]]
        ids, pools = t.ids(rows).tolist(), t.pool[rows].tolist()
        core.release(rows)
        if core.events.active:
            for page_id, pid in zip(ids, pools, strict=True):
                core.events.publish(Event("freed", pid, page_id, None, None))

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

    def offload(self, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray) -> int:
        core = self._core
        ids = check_ids("page_ids", page_ids)
        with core.cond:
            self._core_open()
            self._pool(pool_id)
            return core.starts.offload(core.table.unique(core.table.rows(pool_id, ids)))

    def prefetch(self, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray) -> int:
        core = self._core
        ids = check_ids("page_ids", page_ids)
        with core.cond:
            self._core_open()
            pool = self._pool(pool_id)
            rows = core.table.unique(core.table.rows(pool_id, ids))
            on_cpu = rows[core.table.at(rows, Tier.CPU)][: pool.dev.num_free]
            on_disk = rows[core.table.below_cpu(rows)]
            starts = core.starts
            return starts.restore_cpu(pool, on_cpu, urgent=False) + starts.restore_below(on_disk)

    def set_priority(
        self, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray, priority: float
    ) -> None:
        check_priority("priority", priority)
        core = self._core
        ids = check_ids("page_ids", page_ids)
        with core.cond:
            self._pool(pool_id)
            rows = core.table.unique(core.table.rows(pool_id, ids))
            core.table.set_priority(rows, priority)
            tracked = rows[core.table.settled(rows)]
            for tier, pool, size, part in core.groups(tracked):
                core.policy_of(tier, pool, size).update(part, core.meta(part))

    def page_info(self, pool_id: PoolId, page_id: PageId) -> PageInfo:
        with self._core.cond:
            t = self._core.table
            row = t.row(pool_id, page_id)
            state = t.page_state(row)
            tier = None if state is PageState.DROPPED else self._core.wire[int(t.tier[row])]
            slot = int(t.slot[row]) if state is PageState.GPU else None
            return PageInfo(PageId(page_id), state, tier, slot, int(t.pins[row]))

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
            put_page(pool.segments, slots[0], flat)
        finally:
            self.release(pool_id, [page_id])

    def read(self, pool_id: PoolId, page_id: PageId) -> torch.Tensor:
        """A CPU copy of the page's bytes."""
        pool = self.pool(pool_id)
        slots = self.acquire(pool_id, [page_id])
        if slots is None:
            raise FailedPrecondition(f"pool {pool_id} has no unpinned slot to read into")
        try:
            return page(pool.segments, slots[0]).cpu()
        finally:
            self.release(pool_id, [page_id])

    # -- prefix reuse (delegates) -----------------------------------------------------------------
    def store(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int],
              caller: Caller | None = None) -> int:
        return self.prefix.store(pool_id, keys, slots, caller)

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[Tier]:
        return self.prefix.lookup(tenant, keys)

    def forget(self, pool_id: PoolId, keys: Sequence[bytes]) -> int:
        return self.prefix.forget(pool_id, keys)

    def load(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int],
             caller: Caller | None = None) -> int:
        return self.prefix.load(pool_id, keys, slots, caller)

    def load_layers(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int],
                    bounds: Sequence[int], caller: Caller | None = None) -> Iterator[int]:
        return load_layers(self.prefix, pool_id, keys, slots, bounds, caller)

    def borrow(self, pool_id: PoolId, keys: Sequence[bytes],
               plan: Callable[[list[Tier]], int] | None = None,
               patience: Callable[[int], float] | None = None) -> Borrowed:
        return borrow(self.prefix, pool_id, keys, plan, patience)

    # -- operations -----------------------------------------------------------------------------
    def restore_latency(self) -> LatencyHistogram:
        """Every restore's latency so far, as a histogram (a copy); for the metrics exporter."""
        with self._core.cond:
            return self._core.counters.restore_latency.copy()

    def subscribe(self, maxsize: int = 1024) -> EventSubscription:
        return self._core.events.subscribe(maxsize)

    def stats(self, tenant: str | None = None) -> EngineStats:
        """The daemon-wide snapshot, or with ``tenant`` that tenant's own view only."""
        core = self._core
        if tenant is not None:
            with core.cond:
                return tenant_stats(core, tenant)
        with core.cond:
            local = (Tier.GPU, Tier.CPU, Tier.DISK)  # the page homes the wire reports
            count = core.table.tier_counts(tiers=len(local)).tolist()
            restores, offloads = core.scheduler.depth()
            return EngineStats(
                tiers=tuple(TierStats(t, *self._usage(t), count[t]) for t in local),
                media=core.media_stats(),
                pools=len(core.pools),
                tenants=len({p.tenant for p in core.pools.values()}),
                queued_restores=restores,
                queued_offloads=offloads,
                inflight_bytes=core.scheduler.inflight_bytes,
                pinned_pages=sum(p.pinned for p in core.pools.values()),
                keyed_pages=len(core.table.by_key),
                counters=core.counters,
                remote=core.remote.stats() if core.remote is not None else None,
            )

    def _usage(self, tier: Tier) -> tuple[int, int]:
        """(used, capacity) bytes of a tier of the chain; (0, 0) for one not open."""
        core = self._core
        if tier is Tier.GPU:
            pools = core.pools.values()
            return (sum(p.used_slots * p.page_size for p in pools),
                    sum(p.num_slots * p.page_size for p in pools))
        if tier is Tier.CPU:
            return core.host.used_bytes, core.host.capacity_bytes
        below = [m for level, m in core.media.items() if core.wire[level] is tier]
        return sum(m.used_bytes for m in below), sum(m.capacity_bytes for m in below)

    def close(self, grace: float = 10.0) -> None:
        """Stop accepting work, write keyed CPU-tier pages to disk (``kvtier.prefix.flush``),
        finish transfers in flight, persist the disk index; all within about ``grace`` seconds."""
        core = self._core
        deadline = time.monotonic() + grace
        with core.cond:
            if core.closed:
                return
            core.closed = True
            core.wake_all()
        self._watermarks.stop()
        flush_keyed(core, grace * FLUSH_SHARE)
        if core.remote is not None:  # drains the write-behind queue within what is left
            core.remote.close(max(0.1, deadline - time.monotonic()))
        core.scheduler.close(max(0.1, deadline - time.monotonic()))
        for inline in core.inline_restores.values():
            inline.close()
        with core.cond:
            for pool in list(core.pools.values()):
                pool.dev.close()
        for medium in core.media.values():
            medium.close()
        core.host.close()
        core.events.close()

    def __enter__(self) -> TierEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def configure_offload(config: OffloadConfig | None = None) -> TierEngine:
    """The documented entry point: an engine built from ``config`` (default: the environment)."""
    return TierEngine(config or OffloadConfig.from_env())
