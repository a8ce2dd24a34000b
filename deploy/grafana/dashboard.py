#!/usr/bin/env python3
"""Generate the Grafana dashboard ``kvtier.json`` from the panel list below.

``python deploy/grafana/dashboard.py`` rewrites the JSON; ``--check`` exits 1 if the committed
file differs from what this code generates. Every query uses only names from deploy/metrics.txt
(a test checks that), filtered by the ``$job`` and ``$instance`` variables.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "kvtier.json"
SEL = 'job=~"$job", instance=~"$instance"'
RATE = "$__rate_interval"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    max: float | None = None


def _quantile(q: str) -> str:
    return (
        f"histogram_quantile({q}, sum by (le) "
        f"(rate(kvtier_restore_latency_seconds_bucket{{{SEL}}}[{RATE}])))"
    )


PANELS: tuple[Panel, ...] = (
    Panel(
        "Tier occupancy",
        "percentunit",
        (
            (
                f"sum by (tier) (kvtier_tier_used_bytes{{{SEL}}}) / "
                f"sum by (tier) (kvtier_tier_capacity_bytes{{{SEL}}} > 0)",
                "{{tier}}",
            ),
        ),
        "Used bytes over budget per tier (tiers with no budget are hidden).",
        1.0,
    ),
    Panel(
        "Tier used bytes",
        "bytes",
        ((f"sum by (tier) (kvtier_tier_used_bytes{{{SEL}}})", "{{tier}}"),),
    ),
    Panel(
        "Bytes moved per direction",
        "Bps",
        (
            (
                f"sum by (direction) (rate(kvtier_moved_bytes_total{{{SEL}}}[{RATE}]))",
                "{{direction}}",
            ),
        ),
    ),
    Panel(
        "Restore latency",
        "s",
        ((_quantile("0.5"), "p50"), (_quantile("0.99"), "p99")),
        "Time from a restore request until the page is resident on the GPU.",
    ),
    Panel(
        "Queue depths",
        "short",
        (
            (f"sum by (queue) (kvtier_queue_depth{{{SEL}}})", "{{queue}}"),
            (f"sum(kvtier_inflight_bytes{{{SEL}}}) / 1048576", "in flight (MiB)"),
        ),
    ),
    Panel(
        "Hit ratio per tier",
        "percentunit",
        (
            (
                f"sum by (tier) (rate(kvtier_hits_total{{{SEL}}}[{RATE}])) / scalar("
                f"sum(rate(kvtier_hits_total{{{SEL}}}[{RATE}])) + "
                f"sum(rate(kvtier_misses_total{{{SEL}}}[{RATE}])))",
                "{{tier}}",
            ),
        ),
        "Share of lookups answered from each tier; the rest are misses.",
        1.0,
    ),
    Panel(
        "Evictions",
        "ops",
        ((f"sum by (tier) (rate(kvtier_evictions_total{{{SEL}}}[{RATE}]))", "{{tier}}"),),
    ),
    Panel(
        "Drops and checksum failures",
        "ops",
        (
            (f"sum by (reason) (rate(kvtier_drops_total{{{SEL}}}[{RATE}]))", "drop: {{reason}}"),
            (f"sum(rate(kvtier_checksum_failures_total{{{SEL}}}[{RATE}]))", "checksum failures"),
            (
                f"sum by (direction) (rate(kvtier_transfer_failures_total{{{SEL}}}[{RATE}]))",
                "transfer failed: {{direction}}",
            ),
        ),
        "Any non-zero value means cached pages were lost (never served wrong).",
    ),
    Panel(
        "Attached engines and pinned pages",
        "short",
        (
            (f"sum(kvtier_attached_engines{{{SEL}}})", "attached engines"),
            (f"sum(kvtier_pinned_pages{{{SEL}}})", "pinned pages"),
        ),
    ),
    Panel(
        "Remote tier traffic",
        "Bps",
        (
            (
                f"sum by (direction) (rate(kvtier_remote_bytes_total{{{SEL}}}[{RATE}]))",
                "{{direction}}",
            ),
            (f"sum(kvtier_remote_queued_bytes{{{SEL}}})", "queued for write"),
        ),
        "Page bytes written to and read from the shared Redis/Valkey store.",
    ),
    Panel(
        "Remote tier health",
        "short",
        (
            (f"min(kvtier_remote_up{{{SEL}}} or kvtier_remote_enabled{{{SEL}}} == 0)", "up"),
            (
                f"sum by (kind) (rate(kvtier_remote_errors_total{{{SEL}}}[{RATE}]))",
                "error: {{kind}}",
            ),
            (
                f"sum by (reason) (rate(kvtier_remote_dropped_writes_total{{{SEL}}}[{RATE}]))",
                "dropped write: {{reason}}",
            ),
            (
                f"sum by (reason) (rate(kvtier_remote_rejected_total{{{SEL}}}[{RATE}]))",
                "refused value: {{reason}}",
            ),
        ),
        "Refused values are damaged or foreign entries in the shared store (served as misses).",
    ),
    Panel(
        "RPC latency p99 per method",
        "s",
        (
            (
                f"histogram_quantile(0.99, sum by (le, method) "
                f"(rate(kvtier_rpc_latency_seconds_bucket{{{SEL}}}[{RATE}])))",
                "{{method}}",
            ),
        ),
    ),
)


def _panel(i: int, p: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit, "min": 0}
    if p.max is not None:
        defaults["max"] = p.max
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
            for j, (expr, legend) in enumerate(p.queries)
        ],
    }


def _variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }


def build() -> dict[str, Any]:
    datasource = {"name": "datasource", "type": "datasource", "query": "prometheus"}
    return {
        "uid": "kvtier",
        "title": "kvtier",
        "tags": ["kvtier"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                datasource,
                _variable("job", "label_values(kvtier_build_info, job)"),
                _variable("instance", 'label_values(kvtier_build_info{job=~"$job"}, instance)'),
            ]
        },
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if kvtier.json is stale")
    args = parser.parse_args(argv)
    want = render()
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != want:
            print(f"{OUT.name} is stale: run python deploy/grafana/dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(want, encoding="utf-8")
    print(f"wrote {OUT.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
