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


def test_best_fwd_bwd_row_judges_activation_peak_on_forward_backward_time() -> None:
    report = runpy.run_path(str(ROOT / "benchmarks" / "training_report.py"))
    R = report["Result"]
    base = R("no_offload", 4, True, 0, step_s=2.0, fwd_s=0.3, fwdbwd_s=1.0, peak_gib=10.0,
             act_peak_gib=6.0)
    res = {"no_offload": base,
           # within +10% of the step but not of forward+backward
           "a": R("kvtier_act@6", 4, True, 6, step_s=2.1, fwdbwd_s=1.2, peak_gib=5.0,
                  act_peak_gib=1.0),
           "b": R("kvtier_act@3", 4, True, 3, step_s=2.1, fwdbwd_s=1.09, peak_gib=7.5,
                  act_peak_gib=3.5)}
    assert report["best_within"](res, base).variant == "kvtier_act@6"
    fb = report["best_within"](res, base, time="fwdbwd_s", peak="act_peak_gib")
    assert fb.variant == "kvtier_act@3"


def test_tiny_optimizer_benchmark_rows_and_checks(tmp_path: Path) -> None:
    optim = runpy.run_path(str(ROOT / "benchmarks" / "training_optim.py"))
    out = tmp_path / "optim.json"
    assert optim["main"](["--tiny", "--warmup", "0", "--steps", "1", "--plan",
                          "mlp:plain,kvtier_cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert rows["plain"]["ok"] and rows["kvtier_cpu"]["ok"], rows
    assert rows["kvtier_cpu"]["loss"] == rows["plain"]["loss"]  # same model, same data
    assert rows["kvtier_cpu"]["ratio"] > 0
    assert "mlp_cpu_le_1.10x_plain" in data["checks"]
    with pytest.raises(SystemExit):
        optim["parse"](["--plan", "mlp:nope", "--out", "x.json"])


def test_optimizer_checks_judge_against_peers_and_raw_disk() -> None:
    optim = runpy.run_path(str(ROOT / "benchmarks" / "training_optim.py"))
    rows = [dict(shape="mlp", variant="plain", ok=True, step_s=1.0, peak_gib=20.0),
            dict(shape="mlp", variant="torchao", ok=True, step_s=1.2, peak_gib=10.0, ratio=1.2),
            dict(shape="mlp", variant="kvtier_cpu", ok=True, step_s=1.15, peak_gib=10.0,
                 ratio=1.15),
            dict(shape="disk", variant="raw_disk", ok=True, read_gbs=3.0, write_gbs=1.0),
            dict(shape="disk", variant="kvtier_disk", ok=True, step_s=2.0, peak_gib=1.0,
                 disk_gbs=1.0, disk_read_per_step=3e9, disk_written_per_step=1e9)]
    checks = optim["checks_of"](rows)
    assert checks["mlp_cpu_le_1.10x_plain"] is False
    assert checks["mlp_cpu_not_slower_than_torchao"] is True
    assert checks["mlp_cpu_peak_le_torchao"] is True
    assert checks["disk_tier_share_of_raw"] == pytest.approx(1.0)  # 1 s + 1 s of 2 s


def test_drained_sweep_point_is_a_variant(bench: dict[str, Any]) -> None:
    a = bench["parse"](["--variants", "no_offload,kvtier_act@3+", "--out", "x.json"])
    assert a.variants == ["no_offload", "kvtier_act@3+"]
    variants = runpy.run_path(str(ROOT / "benchmarks" / "training_variants.py"))
    assert variants["offload_groups"]("kvtier_act@3+", 4) == 3
    assert variants["inflight_bound"]("kvtier_act@3+") is None
