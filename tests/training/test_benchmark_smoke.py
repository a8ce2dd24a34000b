"""The training benchmark runs end to end on tiny shapes and writes JSON + markdown."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_benchmark_writes_results(tmp_path: Path) -> None:
    mod = runpy.run_path(str(ROOT / "benchmarks" / "training.py"))
    out = tmp_path / "training.json"
    assert mod["main"](["--tiny", "--no-search", "--steps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["variant"] for r in data["results"]} >= {"no_offload", "kvtier_act",
                                                        "kvtier_opt_cpu", "save_on_cpu"}
    assert all(r["ok"] for r in data["results"])
    assert out.with_suffix(".md").read_text().startswith("# Training offload")
