"""Prometheus series of the remote tier (``kvtier.prefix.remote``), read from one stats snapshot.

Exported whether or not a remote tier is configured (``kvtier_remote_enabled`` 0, counters 0),
so dashboards and alerts see every series; every label value a counter can take is exported at 0.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.prefix.remote import RemoteStats

REMOTE_METRIC_NAMES = (
    "kvtier_remote_enabled", "kvtier_remote_up", "kvtier_remote_bytes_total",
    "kvtier_remote_pages_total", "kvtier_remote_queued_bytes",
    "kvtier_remote_dropped_writes_total", "kvtier_remote_rejected_total",
    "kvtier_remote_errors_total",
)
DROP_REASONS = ("closed", "queue_full", "store")
REJECT_REASONS = ("header", "key", "length", "mac")
ERROR_KINDS = ("cluster", "connection", "oom", "other", "protocol", "timeout")


def remote_metrics(r: RemoteStats | None) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvtier_remote_enabled", "1 when a remote tier is configured.", value=int(r is not None))
    r = r or RemoteStats(False, 0, 0, 0, 0, 0)
    yield GaugeMetricFamily(
        "kvtier_remote_up", "1 while the remote store answers.", value=int(r.reachable))
    moved = CounterMetricFamily(
        "kvtier_remote_bytes_total",
        "Bytes of values (framed pages) written to / read from the remote store.",
        labels=["direction"])
    pages = CounterMetricFamily(
        "kvtier_remote_pages_total", "Pages written to / read from the remote store.",
        labels=["direction"])
    moved.add_metric(["write"], r.written_bytes)
    moved.add_metric(["read"], r.read_bytes)
    pages.add_metric(["write"], r.written_pages)
    pages.add_metric(["read"], r.read_pages)
    yield from (moved, pages)
    yield GaugeMetricFamily(
        "kvtier_remote_queued_bytes", "Bytes waiting in the write-behind queue.",
        value=r.queued_bytes)
    for name, doc, label, known, counts in (
        ("kvtier_remote_dropped_writes_total", "Remote writes dropped.", "reason", DROP_REASONS,
         r.dropped),
        ("kvtier_remote_rejected_total", "Remote values refused (a miss).", "reason",
         REJECT_REASONS, r.rejected),
        ("kvtier_remote_errors_total", "Remote store faults.", "kind", ERROR_KINDS, r.errors),
    ):
        fam = CounterMetricFamily(name, doc, labels=[label])
        for value in sorted(set(known) | set(counts)):
            fam.add_metric([value], counts.get(value, 0))
        yield fam
