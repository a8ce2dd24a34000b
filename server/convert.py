"""Plain translation between engine values and ``kvtier.v1`` messages (no decisions)."""

from __future__ import annotations

from typing import Any, cast

from kvtier.stats import EngineStats
from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb

_HANDLE_KINDS = {"cuda_ipc": pb.HANDLE_KIND_CUDA_IPC, "memfd": pb.HANDLE_KIND_MEMFD}


def tier(t: Tier | int) -> pb.Tier:
    return cast(pb.Tier, int(t))  # kvtier.v1.Tier values equal kvtier.types.Tier values


def attach_reply(pool: Any, instance: str, *, registered: bool = False) -> pb.AttachReply:
    """A registered pool's memory belongs to the engine that sent it: no handle goes back.
    A memfd pool's descriptor goes over the session socket (the servicer adds the lease)."""
    handle = pb.PoolHandle()
    if not registered:
        h = pool.handle()
        handle = pb.PoolHandle(kind=_HANDLE_KINDS.get(h.kind, pb.HANDLE_KIND_UNSPECIFIED),
                               device=h.device, ipc=h.ipc)
    return pb.AttachReply(
        pool_id=int(pool.pool_id),
        page_size=int(pool.page_size),
        num_slots=int(pool.num_slots),
        handle=handle,
        instance=instance,
    )


def stats_reply(s: EngineStats, version: str, instance: str) -> pb.StatsReply:
    c = s.counters
    moved = [
        pb.DirectionStats(
            direction=d.name.lower(),
            bytes=m.bytes,
            pages=m.pages,
            batches=m.batches,
            seconds=m.seconds,
            failures=m.failures,
            bytes_per_s=m.bytes_per_s,
            latency_s=m.latency_s,
        )
        for d, m in c.moved.items()
    ]
    return pb.StatsReply(
        tiers=[
            pb.TierStats(tier=tier(t.tier), used_bytes=t.used_bytes,
                         capacity_bytes=t.capacity_bytes, pages=t.pages)
            for t in s.tiers
        ],
        pools=s.pools,
        tenants=s.tenants,
        queued_restores=s.queued_restores,
        queued_offloads=s.queued_offloads,
        inflight_bytes=s.inflight_bytes,
        pinned_pages=s.pinned_pages,
        keyed_pages=s.keyed_pages,
        moved=moved,
        evictions={t.name.lower(): n for t, n in c.evictions.items()},
        drops=dict(c.drops),
        hits={t.name.lower(): n for t, n in c.hits.items()},
        misses=c.misses,
        checksum_failures=c.checksum_failures,
        version=version,
        instance=instance,
        remote=remote_stats(s.remote),
    )


def remote_stats(r: Any) -> pb.RemoteStats | None:
    if r is None:
        return None
    return pb.RemoteStats(
        reachable=r.reachable, written_pages=r.written_pages, written_bytes=r.written_bytes,
        read_pages=r.read_pages, read_bytes=r.read_bytes, queued_bytes=r.queued_bytes,
        dropped=r.dropped, rejected=r.rejected, errors=r.errors,
    )


def event(e: Any) -> pb.Event:
    msg = pb.Event(kind=str(e.kind), pool_id=int(e.pool_id or 0), page_id=int(e.page_id))
    if e.src is not None:
        msg.src = tier(e.src)
    if e.dst is not None:
        msg.dst = tier(e.dst)
    return msg
