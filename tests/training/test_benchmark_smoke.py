"""The training benchmark runs end to end on tiny shapes and writes JSON + markdown; its checks
pick the honest "within +10% step time" row."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "benchmarks" / "training.py"))


def test_tiny_benchmark_writes_results(bench: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "training.json"
    assert bench["main"](["--tiny", "--no-search", "--steps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    variants = {r["variant"] for r in data["results"]}
    assert variants >= {"no_offload", "kvtier_act", "kvtier_act@1", "kvtier_opt_cpu",
                        "save_on_cpu", "kvtier_opt_gpu_stream"}
    assert all(r["ok"] for r in data["results"])
    act = next(r for r in data["results"] if r["variant"] == "kvtier_act")
    assert act["moved_gib"] > 0 and act["fwd_s"] > 0 and act["groups"] == 2
    assert "best_within_10pct_step" in data["checks"] or \
        data["checks"]["target_ge_40pct_less_peak_at_le_10pct_step"] is False
    assert out.with_suffix(".md").read_text().startswith("# Training offload")


def test_tiny_wide_preset_with_chosen_variants(bench: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "wide.json"
    assert bench["main"](["--tiny", "--shape", "wide8192", "--variants", "no_offload,sweep",
                          "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["optimizer"] == "gpu_stream"
    assert [r["variant"] for r in data["results"]] == [
        "no_offload", "kvtier_act@1", "kvtier_act@2", "kvtier_act@1~1", "kvtier_act@2~1",
        "kvtier_act@1~2", "kvtier_act@2~2"]
    assert [r["inflight"] for r in data["results"]] == [None, None, None, 1, 1, 2, 2]
    assert "OffloadedOptimizer" in data["checks"]["activation_rows_optimizer"]


def test_one_sweep_point_is_a_variant(bench: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    assert bench["main"](["--tiny", "--variants", "no_offload,kvtier_act@2~2",
                          "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["groups"], r["inflight"]) for r in rows] == [
        ("no_offload", 0, None), ("kvtier_act@2~2", 2, 2)]
    with pytest.raises(SystemExit):
        bench["parse"](["--variants", "kvtier_act@x", "--out", "x.json"])


def test_preset_values_and_overrides(bench: dict[str, Any]) -> None:
    a = bench["parse"](["--shape", "wide8192", "--batch", "2", "--out", "x.json"])
    assert (a.layers, a.hidden, a.batch, a.optimizer) == (4, 8192, 2, "gpu_stream")
    assert "search" not in a.variants
    with pytest.raises(SystemExit):
        bench["parse"](["--variants", "nope", "--out", "x.json"])


def test_best_row_is_the_lowest_peak_within_ten_percent() -> None:
    report = runpy.run_path(str(ROOT / "benchmarks" / "training_report.py"))
    R = report["Result"]
    base = R("no_offload", 4, True, 0, step_s=1.0, fwd_s=0.3, peak_gib=10.0, act_peak_gib=6.0)
    res = {"no_offload": base,
           "a": R("kvtier_act@2", 4, True, 2, step_s=1.08, peak_gib=8.0, act_peak_gib=4.0),
           "b": R("kvtier_act@6", 4, True, 6, step_s=1.5, peak_gib=5.0, act_peak_gib=1.0),
           "c": R("kvtier_act@1", 4, True, 1, step_s=1.0, peak_gib=9.0, act_peak_gib=5.0)}
    assert report["best_within"](res, base).variant == "kvtier_act@2"
    # 55 GB/s x (0.3 s + 0.1 s) over 6 GiB of activations
    assert report["bound_of"](base, 55.0) == pytest.approx(55e9 * 0.4 / (6 * 2**30))
