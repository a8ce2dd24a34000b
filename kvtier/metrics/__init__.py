"""Prometheus export of the engine's plain counters (the only module importing prometheus_client).

A :class:`DaemonMetrics` owns its own ``CollectorRegistry`` (no global state). Engine series are
read from ``engine.stats()`` at scrape time by a custom collector; RPC series are observed by the
server interceptor. Names are a contract with dashboards and alerts (``deploy/metrics.txt``):
change them only together.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.metrics import http
from kvtier.metrics.remote import REMOTE_METRIC_NAMES, remote_metrics
from kvtier.stats import LATENCY_BUCKETS, EngineStats, LatencyHistogram
from kvtier.types import Direction, Tier

METRIC_NAMES = (
    "kvtier_tier_used_bytes", "kvtier_tier_capacity_bytes", "kvtier_tier_pages",
    "kvtier_moved_bytes_total", "kvtier_moved_pages_total", "kvtier_transfer_seconds_total",
    "kvtier_transfer_failures_total", "kvtier_restore_latency_seconds",
    "kvtier_rpc_latency_seconds", "kvtier_rpc_errors_total", "kvtier_queue_depth",
    "kvtier_inflight_bytes", "kvtier_evictions_total", "kvtier_drops_total",
    "kvtier_checksum_failures_total", "kvtier_hits_total", "kvtier_misses_total",
    "kvtier_acquired_pages_total",
    "kvtier_attached_engines", "kvtier_pinned_pages", "kvtier_build_info",
    "kvtier_medium_used_bytes", "kvtier_medium_capacity_bytes", "kvtier_medium_pages",
    "kvtier_medium_evictions_total",
    *REMOTE_METRIC_NAMES,
)


def _tier(t: Tier) -> str:
    return t.name.lower()


def _direction(d: Direction) -> str:
    return d.name.lower()


# Every reason the engine can drop a page for: exported at 0 so dashboards and alerts see them.
DROP_REASONS = ("abandoned", "cpu_full", "corrupt", "disk_full", "no_admission", "replaced",
                "shutdown", "tenant_quota")


def restore_histogram(h: LatencyHistogram) -> HistogramMetricFamily:
    """The engine's restore latencies as Prometheus's cumulative buckets (every restore counted:
    the engine keeps counts, not samples)."""
    cumulative = list(itertools.accumulate(h.counts))
    bounds = [repr(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]
    return HistogramMetricFamily(
        "kvtier_restore_latency_seconds", "Time from a restore request to the page on the GPU.",
        buckets=list(zip(bounds, cumulative, strict=True)), sum_value=h.total_s)


class EngineCollector(Collector):
    """Reads one stats snapshot and the engine's restore-latency histogram per scrape."""

    def __init__(self, engine: Any, version: str) -> None:
        self._engine = engine
        self._version = version

    def collect(self) -> Iterator[Metric]:
        s: EngineStats = self._engine.stats()
        yield from self._tiers(s)
        yield from self._media(s)
        yield from self._moves(s)
        yield from self._engine_totals(s)
        yield from remote_metrics(s.remote)
        yield restore_histogram(self._engine.restore_latency())
        build = GaugeMetricFamily("kvtier_build_info", "kvtier version (1).", labels=["version"])
        build.add_metric([self._version], 1)
        yield build

    def _tiers(self, s: EngineStats) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes in use.", labels=["tier"])
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Budget per tier.", labels=["tier"])
        pages = GaugeMetricFamily("kvtier_tier_pages", "Pages resident per tier.", labels=["tier"])
        for t in s.tiers:
            used.add_metric([_tier(t.tier)], t.used_bytes)
            cap.add_metric([_tier(t.tier)], t.capacity_bytes)
            pages.add_metric([_tier(t.tier)], t.pages)
        queue = GaugeMetricFamily("kvtier_queue_depth", "Queued transfers.", labels=["queue"])
        queue.add_metric(["restore"], s.queued_restores)
        queue.add_metric(["offload"], s.queued_offloads)
        yield from (used, cap, pages, queue)
        yield GaugeMetricFamily("kvtier_inflight_bytes", "Bytes in flight.", value=s.inflight_bytes)
        yield GaugeMetricFamily(
            "kvtier_attached_engines",
            "Engine attachments: page pools created by Attach or Register and not yet detached.",
            value=s.pools)
        yield GaugeMetricFamily("kvtier_pinned_pages", "Pinned pages.", value=s.pinned_pages)

    def _media(self, s: EngineStats) -> Iterator[Metric]:
        """Each medium of the tier chain below the CPU, by its registered name (bounded: the
        chain's own names)."""
        lab = ["medium"]
        used = GaugeMetricFamily("kvtier_medium_used_bytes",
                                 "Bytes in use per medium below the CPU.", labels=lab)
        cap = GaugeMetricFamily("kvtier_medium_capacity_bytes", "Budget per medium below the CPU.",
                                labels=lab)
        pages = GaugeMetricFamily("kvtier_medium_pages", "Pages resident per medium below the CPU.",
                                  labels=lab)
        ev = CounterMetricFamily("kvtier_medium_evictions_total",
                                 "Pages pushed out of a medium below the CPU.", labels=lab)
        for m in s.media:
            used.add_metric([m.name], m.used_bytes)
            cap.add_metric([m.name], m.capacity_bytes)
            pages.add_metric([m.name], m.pages)
            ev.add_metric([m.name], m.evictions)
        yield from (used, cap, pages, ev)

    def _moves(self, s: EngineStats) -> Iterator[Metric]:
        lab = ["direction"]
        fams = {
            "bytes": CounterMetricFamily("kvtier_moved_bytes_total", "Bytes moved.", labels=lab),
            "pages": CounterMetricFamily("kvtier_moved_pages_total", "Pages moved.", labels=lab),
            "seconds": CounterMetricFamily(
                "kvtier_transfer_seconds_total", "Time spent in transfers.", labels=lab),
            "failures": CounterMetricFamily(
                "kvtier_transfer_failures_total", "Failed transfer batches.", labels=lab),
        }
        for d, m in s.counters.moved.items():
            for attr, fam in fams.items():
                fam.add_metric([_direction(d)], getattr(m, attr))
        yield from fams.values()

    def _engine_totals(self, s: EngineStats) -> Iterator[Metric]:
        c = s.counters
        ev = CounterMetricFamily("kvtier_evictions_total", "Pages evicted.", labels=["tier"])
        hits = CounterMetricFamily("kvtier_hits_total", "Blocks lookups found, per tier.",
                                   labels=["tier"])
        acquired = CounterMetricFamily(
            "kvtier_acquired_pages_total", "Pages acquired, per tier they were found in.",
            labels=["tier"])
        for t in Tier:
            ev.add_metric([_tier(t)], c.evictions.get(t, 0))
            hits.add_metric([_tier(t)], c.hits.get(t, 0))
            acquired.add_metric([_tier(t)], c.acquired.get(t, 0))
        drops = CounterMetricFamily("kvtier_drops_total", "Pages dropped.", labels=["reason"])
        for reason in sorted(set(DROP_REASONS) | set(c.drops)):
            drops.add_metric([reason], c.drops.get(reason, 0))
        yield from (ev, hits, acquired, drops)
        yield CounterMetricFamily("kvtier_misses_total", "Blocks lookups found nowhere.",
                                  value=c.misses)
        yield CounterMetricFamily(
            "kvtier_checksum_failures_total", "Pages failing checksum.", value=c.checksum_failures)


class DaemonMetrics:
    """The daemon's registry: engine series plus RPC latency and errors."""

    def __init__(self, engine: Any, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, version))
        self._latency = Histogram(
            "kvtier_rpc_latency_seconds",
            "Call latency: gRPC calls, and Acquire/Release answered on the fast lane.",
            ["method"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._errors = Counter(
            "kvtier_rpc_errors", "gRPC calls ending with a non-OK status.", ["method", "code"],
            registry=self.registry,
        )
        self._server: Any = None

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._latency.labels(method).observe(seconds)
        if code != "OK":
            self._errors.labels(method, code).inc()

    def serve(self, addr: str) -> int:
        """Serve /metrics on ``host:port``; returns the bound port."""
        host, _, port = addr.rpartition(":")
        server = http.serve(host.strip("[]") or "0.0.0.0", int(port), self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
