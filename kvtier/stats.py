"""Plain counters and snapshots the engine keeps on its hot paths.

Only ``kvtier.metrics`` turns these into Prometheus series; everything here is a plain number so
the engine, tests and ``kvtier status`` can read it without prometheus_client.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.types import Direction, Tier

if TYPE_CHECKING:
    from kvtier.prefix.remote import RemoteStats


# Upper bounds (seconds) of the latency histograms' buckets (then +Inf).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class LatencyHistogram:
    """Every sample counted in fixed memory: a count per bucket of ``LATENCY_BUCKETS`` (a sample
    goes to the first bound >= it; the last count is +Inf's), and the samples' sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total_s += seconds

    def copy(self) -> LatencyHistogram:
        return LatencyHistogram(self.counts[:], self.total_s)


RATE_WEIGHT = 0.25  # of the newest batch in the moving averages behind ``bytes_per_s``
SPREAD = 0.05  # batch sizes must vary this much (coefficient of variation) to see a latency


@dataclass(slots=True)
class DirectionCounters:
    """Per medium pair: what moved and how long it took.

    ``bytes_per_s`` and ``latency_s``: the recent cost of a batch, ``seconds = latency_s + bytes
    / bytes_per_s``, fitted to moving averages of batches' bytes and busy seconds (newest
    weighted ``RATE_WEIGHT``). While batch sizes hardly vary, ``latency_s`` is 0 and the rate is
    bytes over seconds. Both 0 until a batch moved bytes. Cost-aware loads (``kvtier.planner``)
    read them.
    """

    bytes: int = 0
    pages: int = 0
    batches: int = 0
    seconds: float = 0.0
    failures: int = 0
    avg_bytes: float = 0.0
    avg_seconds: float = 0.0
    avg_bytes2: float = 0.0  # of bytes squared
    avg_bytes_seconds: float = 0.0  # of bytes times seconds

    def observe(self, nbytes: int, seconds: float) -> None:
        """A completed batch moved ``nbytes`` good bytes in ``seconds`` of busy time."""
        if nbytes <= 0 or seconds <= 0:
            return
        w = RATE_WEIGHT if self.avg_seconds else 1.0
        self.avg_bytes += w * (nbytes - self.avg_bytes)
        self.avg_seconds += w * (seconds - self.avg_seconds)
        self.avg_bytes2 += w * (nbytes * nbytes - self.avg_bytes2)
        self.avg_bytes_seconds += w * (nbytes * seconds - self.avg_bytes_seconds)

    def _fit(self) -> tuple[float, float]:
        """(seconds per byte, latency seconds); (0, 0) before any batch."""
        if not self.avg_seconds:
            return 0.0, 0.0
        var = self.avg_bytes2 - self.avg_bytes**2
        if var > (SPREAD * self.avg_bytes) ** 2:
            slope = (self.avg_bytes_seconds - self.avg_bytes * self.avg_seconds) / var
            latency = self.avg_seconds - slope * self.avg_bytes
            if slope > 0 and latency >= 0:
                return slope, latency
        return self.avg_seconds / self.avg_bytes, 0.0

    def cost_only(self) -> DirectionCounters:
        """A copy with this direction's measured cost (``bytes_per_s``, ``latency_s``) and no
        totals: what the shared lane can do, not how much went through it (a tenant's view)."""
        return DirectionCounters(avg_bytes=self.avg_bytes, avg_seconds=self.avg_seconds,
                                 avg_bytes2=self.avg_bytes2,
                                 avg_bytes_seconds=self.avg_bytes_seconds)

    @property
    def bytes_per_s(self) -> float:
        slope = self._fit()[0]
        return 1 / slope if slope else 0.0

    @property
    def latency_s(self) -> float:
        return self._fit()[1]


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters (exported as ``*_total``)."""

    moved: dict[Direction, DirectionCounters] = field(
        default_factory=lambda: {d: DirectionCounters() for d in Direction}
    )
    evictions: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})
    drops: dict[str, int] = field(
        default_factory=dict
    )  # reason -> count (disk_full, corrupt, no_admission)
    hits: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})  # lookup blocks
    misses: int = 0  # blocks a lookup asked for and found nowhere
    acquired: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})  # pages
    checksum_failures: int = 0
    cancelled_offloads: int = 0
    restore_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    events_dropped: int = 0

    def drop(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n


@dataclass(slots=True, frozen=True)
class TierStats:
    tier: Tier
    used_bytes: int
    capacity_bytes: int
    pages: int


@dataclass(slots=True, frozen=True)
class MediumStats:
    """One medium of the chain below the CPU: its name, level (2 the first) and wire tier."""

    name: str
    level: int
    tier: Tier
    used_bytes: int
    capacity_bytes: int
    pages: int
    evictions: int


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A consistent snapshot taken under the engine lock."""

    tiers: tuple[TierStats, ...]
    pools: int
    tenants: int
    queued_restores: int
    queued_offloads: int
    inflight_bytes: int
    pinned_pages: int
    keyed_pages: int
    counters: EngineCounters
    remote: RemoteStats | None = None  # None without a remote tier
    media: tuple[MediumStats, ...] = ()  # per medium below the CPU, top down (``tiers``: summed)
