"""``kvtier bench`` with an embedded daemon (CPU mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main


def test_bench_embedded_runs_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--seconds", "3", "--engines", "2", "--json", str(out_json)])
    out = capsys.readouterr()
    assert code == 0, out.err
    for word in ("hit rate", "p50 ms", "p99 ms", "restore", "resident", "GB/s", "Acquire"):
        assert word in out.out, out.out
    assert "0 byte mismatches" in out.out
    assert "3.0/3s" in out.err  # the progress bar finished
    data = json.loads(out_json.read_text())
    assert data["mismatches"] == 0 and data["errors"] == [] and data["verified_pages"] > 0
    assert data["samples"], "stats were sampled while running"


def test_bench_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    code = main(["bench", "--seconds", "1", "--engines", "1", "--pages-per-engine", "32",
                 "--plot", str(png)])
    assert code == 0, capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--seconds", "1", "--plot", "x.png"]) == 2
    assert "--plot" in capsys.readouterr().err
