"""Generated files are current, complete, and only use metrics from the contract."""

from __future__ import annotations

import json
import re
from pathlib import Path

from deploy_helpers import ROOT, checks, gen_env

from kvtier.config import describe
from kvtier.metrics import METRIC_NAMES

METRICS = set((ROOT / "deploy" / "metrics.txt").read_text().split())
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _base(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in METRICS:
            return name.removesuffix(suffix)
    return name


def _names_in(text: str) -> set[str]:
    return {_base(n) for n in re.findall(r"\bkvtier_[a-z_]+\b", text)}


def test_generators_check_clean() -> None:
    assert checks.generated_files() == []


def test_check_mode_detects_a_stale_file(tmp_path: Path) -> None:
    gen = gen_env
    stale = tmp_path / "table.md"
    stale.write_text(f"intro\n{gen.BEGIN}\nold table\n{gen.END}\n")
    assert gen.main(["--check", "--table", str(stale)]) == 1
    assert gen.main(["--table", str(stale)]) == 0
    assert gen.main(["--check", "--table", str(stale)]) == 0
    assert "`KVCACHED_OFFLOAD_CPU_MEMORY_GB`" in stale.read_text()


def test_every_setting_is_documented_everywhere() -> None:
    env = (ROOT / "deploy/systemd/kvtier.env").read_text()
    configmap = (ROOT / "deploy/k8s/configmap.yaml").read_text()
    ops = (ROOT / "docs/operations.md").read_text()
    for var, _default, _accepted, doc in describe():
        assert f"#{var}=" in env, var
        assert f"  {var}: " in configmap, var
        assert f"`{var}`" in ops, var
        assert doc in env, var


def test_metrics_contract_names_follow_conventions() -> None:
    lines = (ROOT / "deploy" / "metrics.txt").read_text().splitlines()
    assert len(lines) == len(METRICS) == len(METRIC_NAMES) == 33
    assert set(lines) == set(METRIC_NAMES)
    for name in lines:
        assert re.fullmatch(r"kvtier_[a-z][a-z_]*[a-z]", name), name
        assert ":" not in name


def test_dashboard_and_alerts_use_only_contract_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/kvtier.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"]) + json.dumps(
        dashboard["templating"]
    )
    alerts = (ROOT / "deploy/prometheus/alerts.yaml").read_text()
    assert _names_in(exprs) <= METRICS, _names_in(exprs) - METRICS
    # Alert descriptions mention settings, not metrics: only look at expr lines.
    assert _names_in(alerts) - {"kvtier_"} <= METRICS


def test_dashboard_has_the_required_panels() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/kvtier.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for needed in (
        "kvtier_tier_used_bytes",
        "rate(kvtier_moved_bytes_total",
        "histogram_quantile(0.5",
        "histogram_quantile(0.99",
        "kvtier_queue_depth",
        "kvtier_hits_total",
        "kvtier_evictions_total",
        "kvtier_drops_total",
        "kvtier_checksum_failures_total",
        "kvtier_attached_engines",
    ):
        assert needed in exprs, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
