"""What the engine tells and allows one tenant: GPU pool admission and the tenant's Stats view.

Contract (both run with the engine lock held):
    * ``admit_pool(core, tenant, nbytes)`` raises ``CapacityError`` when a new pool of
      ``nbytes`` does not fit the tenant's GPU quota (the message names the tenant's quota and
      its own use) or the daemon's GPU pool budget (the message names no other tenant's use
      and no free bytes: how full the daemon is belongs to the global view), or its memory
      mappings (``mappings=``) the tenant's quarter of ``mapping_budget()`` or the budget, or
      its slots (``slots=``) the tenant's quarter of ``SLOT_BUDGET`` or the budget.
    * ``tenant_stats(core, tenant)`` is the tenant's own snapshot: its pools, its pages and bytes
      per tier (capacity: its quota, else the tier's size), its pinned and keyed pages, its
      moves, hits, misses, evictions and drops, and each direction's measured cost
      (``bytes_per_s``, ``latency_s``: the daemon's, as in the global view, even before the
      tenant has anything). Queues, in-flight bytes, batch counts, busy seconds, failures and
      checksum failures count every tenant's traffic and read 0 here.

The measured cost is shown to every tenant because it describes the shared lanes, not anyone's
use of them: a tenant can time its own moves to the same effect (timing is not protected, see
docs/operations.md), and a cost-aware loader of a tenant needs it where it may not read the
global view (credentials on).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import CapacityError
from kvtier.stats import EngineCounters, EngineStats, TierStats
from kvtier.tenancy.quotas import DIRECTIONS
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.state.pool import Pool

# Slots every pool holds in all: each costs the daemon ~9 bytes of its own memory (a page-table
# row and a free flag) whoever owns the pool's memory, so registered pools of sparse memfds cost
# their client nothing and the daemon ~150 MB each. 2**26 slots: at most ~600 MB in all.
SLOT_BUDGET = 1 << 26


def admit_pool(core: EngineCore, tenant: str, nbytes: int, *, external: bool,
               slots: int, mappings: int = 1, mapped: int = 0) -> None:
    """Raise ``CapacityError`` if a pool of ``nbytes`` exceeds a quota, the tenant's pool count
    (``max_pools_per_tenant``), its share of the daemon's memory mappings (``mappings``: the
    pool's own), of the address space they take (``mapped`` bytes) or of its slots
    (``slots``), or the budget."""
    pools = [p for p in core.pools.values() if p.tenant == tenant]
    most = core.config.max_pools_per_tenant
    if len(pools) >= most:
        raise CapacityError(f"tenant {tenant!r} holds {len(pools)} pools, the most one tenant may "
                            f"(KVCACHED_OFFLOAD_MAX_POOLS_PER_TENANT={most}); detach one first")
    _admit_mappings(core, pools, mappings)
    _admit_mapped(core, pools, mapped)
    _admit_slots(core, pools, slots)
    mine = sum(p.num_slots * p.page_size for p in pools)
    limit = core.ledger.quota(tenant).gpu
    if limit is not None and mine + nbytes > limit:
        raise CapacityError(
            f"tenant {tenant!r}: a pool of {nbytes} B exceeds its GPU quota "
            f"({mine} B of {limit} B in use)"
        )
    if external:
        return  # engine-owned memory is not the daemon's budget
    used = sum(p.num_slots * p.page_size for p in core.pools.values() if not p.external)
    if used + nbytes > core.config.gpu_budget_bytes:
        raise CapacityError(f"num_slots: a pool of {nbytes} B does not fit the GPU pool budget")


@functools.cache
def mapping_budget() -> int:
    """Memory mappings the daemon's pools may hold in all: half the kernel's per-process limit
    (``vm.max_map_count``, read once), the rest kept for the daemon's own (tiers, libraries,
    threads)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        limit = 65530  # Linux's default
    return max(1024, limit // 2)


def _admit_mappings(core: EngineCore, mine: list[Pool], new: int) -> None:
    """A tenant's pools hold at most a quarter of ``mapping_budget`` (registered memory is
    mapped per distinct memfd or IPC handle: one client's thousands of segments must not use up
    the map count, failing every other tenant's Attach and Register), the daemon's at most all."""
    budget = mapping_budget()
    held = sum(p.dev.mappings for p in mine)
    if held + new > budget // 4:
        raise CapacityError(f"segments: {new} more memory mappings would exceed the tenant's "
                            f"share ({held} of {budget // 4} held); use fewer separate buffers")
    if sum(p.dev.mappings for p in core.pools.values()) + new > budget:
        raise CapacityError("segments: the daemon holds all the memory mappings it may")


MAPPED_BUDGET = 1 << 45  # bytes of address space registered pools may map: 32 of x86-64's 128 TiB


def _admit_mapped(core: EngineCore, mine: list[Pool], new: int) -> None:
    """A tenant's registered pools map at most a quarter of ``MAPPED_BUDGET``, the daemon's at
    most all: a sparse memfd of tens of TiB, declared with two slots far apart, costs nothing
    in memory but took the daemon's address space until another tenant's Attach could not map
    its pool."""
    held = sum(p.dev.mapped_bytes for p in mine)
    if held + new > MAPPED_BUDGET // 4:
        raise CapacityError(f"segments: mapping {new} more bytes would exceed the tenant's share "
                            f"of the daemon's address space ({held} of {MAPPED_BUDGET // 4} "
                            "bytes mapped); register only the memory the slots use")
    if sum(p.dev.mapped_bytes for p in core.pools.values()) + new > MAPPED_BUDGET:
        raise CapacityError("segments: the daemon maps all the registered memory it may")


def _admit_slots(core: EngineCore, mine: list[Pool], new: int) -> None:
    """A tenant's pools hold at most a quarter of ``SLOT_BUDGET`` (one pool of the most slots
    a pool may have), the daemon's at most all."""
    held = sum(p.num_slots for p in mine)
    if held + new > SLOT_BUDGET // 4:
        raise CapacityError(f"num_slots: {new} more slots would exceed the tenant's share "
                            f"({held} of {SLOT_BUDGET // 4} held); detach a pool first")
    if sum(p.num_slots for p in core.pools.values()) + new > SLOT_BUDGET:
        raise CapacityError("num_slots: the daemon's pools hold all the slots they may")


def tenant_stats(core: EngineCore, tenant: str) -> EngineStats:
    """The tenant's own view (see the module docstring)."""
    pools = [p for p in core.pools.values() if p.tenant == tenant]
    ledger, t = core.ledger, core.table
    owner = ledger.find(tenant)
    mine = np.flatnonzero(t.owner == owner) if owner else np.empty(0, dtype=np.int64)
    counts = t.tier_counts(mine)
    caps = (
        sum(p.num_slots * p.page_size for p in pools),
        core.host.capacity_bytes,
        sum(m.capacity_bytes for m in core.media.values()),  # every medium below the CPU
    )
    tiers = []
    for tier in (Tier.GPU, Tier.CPU, Tier.DISK):  # page homes; the remote tier: StatsReply.remote
        used = sum(p.used_slots * p.page_size for p in pools) if tier is Tier.GPU else (
            int(ledger.used(tier)[owner]) if owner else 0)
        limit = int(ledger.limit[tier, owner]) if owner else -1
        cap = caps[tier] if limit < 0 or tier is Tier.GPU else limit
        tiers.append(TierStats(tier, used, cap, int(counts[tier])))
    return EngineStats(
        tiers=tuple(tiers),
        pools=len(pools),
        tenants=1 if pools or owner else 0,
        queued_restores=0,
        queued_offloads=0,
        inflight_bytes=0,
        pinned_pages=sum(p.pinned for p in pools),
        keyed_pages=int(np.count_nonzero(t.pool[mine] == 0)),  # pool 0: stored blocks
        counters=_counters(core, owner),
    )


def _counters(core: EngineCore, owner: int) -> EngineCounters:
    c = EngineCounters(moved={d: m.cost_only() for d, m in core.counters.moved.items()})
    if not owner:
        return c
    ledger = core.ledger
    for direction, i in DIRECTIONS.items():
        c.moved[direction].pages = int(ledger.moved_pages[i, owner])
        c.moved[direction].bytes = int(ledger.moved_bytes[i, owner])
    for tier in Tier:
        c.evictions[tier] = int(ledger.evictions[tier, owner])
        c.hits[tier] = int(ledger.hits[tier, owner])
    c.misses = int(ledger.misses[owner])
    c.drops = {r: int(a[owner]) for r, a in ledger.drops.items() if a[owner]}
    return c
