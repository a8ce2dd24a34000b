"""A real daemon under a small workload: its scrape has every contracted metric and lints clean.

The dashboard and the alert rules are checked against ``deploy/metrics.txt`` elsewhere; this closes
the loop by checking ``deploy/metrics.txt`` against what a running daemon actually serves.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from kvtier_daemon_fixture import Daemon, start  # noqa: E402

from kvtier.errors import NotFound  # noqa: E402


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    daemon: Daemon = start(tmp_path_factory.mktemp("scrape"), pool_pages=4, cpu_pages=4)
    try:
        client = daemon.client("ops")
        att = client.attach(4)
        ids: list[int] = []
        for _ in range(4):  # 16 pages through 4 GPU slots and 4 CPU pages: spills to disk
            got = client.allocate(att, 4)
            assert got is not None
            ids += [p for p, _ in got]
            client.release(att, [p for p, _ in got])
        client.acquire(att, ids[:4])  # restores from CPU/disk: the latency histogram fills
        client.release(att, ids[:4])
        client.lookup([b"nothing-stored"])  # a miss
        with pytest.raises(NotFound):
            client.acquire(att, [10**9])  # an error: the per-code error counter appears
        url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            yield resp.read().decode()
        client.close()
    finally:
        daemon.stop()


def test_scrape_has_every_contracted_metric(scrape: str) -> None:
    samples = [line for line in scrape.splitlines() if line and line[0] != "#"]
    served = {line.split("{")[0].split(" ")[0] for line in samples}
    wanted = [m.strip() for m in (ROOT / "deploy" / "metrics.txt").read_text().splitlines()]
    missing = [
        m for m in wanted
        if m and not m.startswith("#")
        and not ({m, f"{m}_bucket", f"{m}_count", f"{m}_total"} & served)
    ]
    assert not missing, f"metrics in deploy/metrics.txt not served: {missing}"
    count = [line for line in samples if line.startswith("kvtier_restore_latency_seconds_count")]
    assert count and float(count[0].rsplit(" ", 1)[1]) >= 1, "the restore was not observed"
    moved = [line for line in scrape.splitlines() if line.startswith("kvtier_moved_bytes_total{")]
    assert any(float(line.rsplit(" ", 1)[1]) > 0 for line in moved), "workload moved no bytes"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_scrape_passes_promtool_check_metrics(scrape: str) -> None:
    out = subprocess.run(["promtool", "check", "metrics"], input=scrape, text=True,
                         capture_output=True, check=False)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out
