"""Alert rules load in promtool and their unit tests pass."""

from __future__ import annotations

from deploy_helpers import checks, run_check

ALERTS = checks.DEPLOY / "prometheus" / "alerts.yaml"


def test_promtool_check_and_test_rules() -> None:
    assert run_check(checks.promtool_rules) == []


def test_required_alerts_exist() -> None:
    text = ALERTS.read_text()
    for name in (
        "KvtierDown",
        "KvtierRestoreLatencyHigh",
        "KvtierChecksumFailures",
        "KvtierDiskTierFull",
        "KvtierPinnedBudgetExhausted",
    ):
        assert f"alert: {name}\n" in text, name
    assert 'up{job="kvtier"} == 0' in text
