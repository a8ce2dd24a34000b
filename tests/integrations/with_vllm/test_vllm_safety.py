"""vLLM with the connector never serves wrong KV: failed loads, rotten disks, daemon restarts.

Every output is compared token for token with vLLM without the connector (each prompt alone).
Model: GQA 8:2 heads x 64, 3 layers, block size 32 (shapes the other vLLM tests don't use).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiny_model import TinyShape, build_tiny_llama
from vllm_harness import DaemonCtl, kv_config, mismatches, reference, run_engine, stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]  # engines start slowly

SHAPE = TinyShape(layers=3, hidden=512, heads=8, kv_heads=2, intermediate=512)
CPU_1MIB = 1 / 1024  # ~10 pages of 96 KiB: everything else goes to disk


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(n)]


def scenario_prompts() -> dict[str, Any]:
    rng = random.Random(5)
    p = toks(rng, 230)
    r = toks(rng, 256)
    out: dict[str, Any] = {
        "P": p, "X": p[:70] + toks(rng, 20), "Y": p[:100] + toks(rng, 20),
        "C": p[:100] + toks(rng, 150), "fill": [toks(rng, 300) for _ in range(4)],
        "Q": {k: r[:k] + toks(rng, 30) for k in (64, 100, 150, 200, 250)},
    }
    away = {n: toks(rng, 100) for n in ("A", "B", "C2", "D")}
    away["D2"] = away["D"][:96] + toks(rng, 20)
    out["away"] = away
    return out


@pytest.fixture(scope="module")
def model_and_ref(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("safety")
    model = build_tiny_llama(tmp / "model", SHAPE)
    s = scenario_prompts()
    prompts = [s["X"], s["Y"], s["C"], *s["Q"].values(), *s["away"].values(), s["fill"][0]]
    return model, reference(tmp, model, prompts)


def corrupt_all(disk: Path) -> None:
    for data in disk.glob("pages-*.dat"):
        with open(data, "r+b") as fh:
            fh.write(os.urandom(data.stat().st_size))


def test_failed_load_never_poisons_the_cache(model_and_ref, tmp_path: Path) -> None:
    """The issue's sequence: rotten pages, a restart, then prompts that re-store the chain."""
    model, ref = model_and_ref
    s = scenario_prompts()
    d = DaemonCtl(tmp_path / "k.sock", cpu_gb=CPU_1MIB, disk=tmp_path / "disk")
    d.start()
    try:
        run_engine(tmp_path, "store", model, [[s["P"]], s["fill"]],
                   kv_config(d.address, tmp_path, "store"))
        d.stop()
        corrupt_all(tmp_path / "disk")
        d.start()
        seq = [s["X"], s["X"], s["C"], s["Y"], s["C"]]
        got = run_engine(tmp_path, "seq", model, [[p] for p in seq],
                         kv_config(d.address, tmp_path, "seq"))
        assert mismatches(seq, got, ref) == []
        fresh = run_engine(tmp_path, "fresh", model, [[s["C"]]],
                           kv_config(d.address, tmp_path, "fresh"))
        assert mismatches([s["C"]], fresh, ref) == []
        st = stats(tmp_path, "seq")
        assert st["load_failed_blocks"] > 0, st  # the rotten pages were tried and refused
        assert stats(tmp_path, "fresh")["loaded_blocks"] > 0
    finally:
        d.stop()


def damage(disk: Path, rng: random.Random) -> None:
    """Rot a quarter of the pages (64 garbage bytes), zero a sixth, cut off the last quarter."""
    for data in sorted(disk.glob("pages-*.dat")):
        page = int(data.stem.split("-")[1])
        n = data.stat().st_size // page
        with open(data, "r+b") as fh:
            for i in range(n):
                r = rng.random()
                if r < 0.25:
                    fh.seek(i * page + rng.randrange(page - 64))
                    fh.write(os.urandom(64))
                elif r < 0.42:
                    fh.seek(i * page)
                    fh.write(bytes(page))
        os.truncate(data, (n - n // 4) * page)


def test_random_load_failures_between_steps(model_and_ref, tmp_path: Path) -> None:
    """Rotten and cut page files, eviction under pressure, SIGTERM and kill -9 restarts."""
    model, ref = model_and_ref
    s = scenario_prompts()
    q, rng = s["Q"], random.Random(7)
    d = DaemonCtl(tmp_path / "k.sock", cpu_gb=CPU_1MIB, disk=tmp_path / "disk")
    d.start()
    try:
        run_engine(tmp_path, "store", model, [[q[250]], s["fill"][:3]],
                   kv_config(d.address, tmp_path, "store"))
        phases = [[q[64]], [q[100], q[150]], [q[200], s["fill"][0]], [q[250], q[64], q[150]]]
        pauses = {0: lambda: damage(tmp_path / "disk", rng), 1: d.restart,
                  2: lambda: d.restart(signal.SIGKILL)}
        got = run_engine(tmp_path, "mixed", model, phases,
                         kv_config(d.address, tmp_path, "mixed"), on_pause=pauses)
        flat = [p for ph in phases for p in ph]
        assert mismatches(flat, got, ref) == []
        again = [q[250], q[200]]
        got = run_engine(tmp_path, "again", model, [[p] for p in again],
                         kv_config(d.address, tmp_path, "again"))
        assert mismatches(again, got, ref) == []
        st = stats(tmp_path, "mixed")
        assert st["loaded_blocks"] + st["load_failed_blocks"] > 0, st
        # Re-attached after the restarts (once per restart, or once for both when the worker
        # was still backing off from the first when the second came).
        assert st["attaches"] >= 2 and st["outages"] >= 1, st
    finally:
        d.stop()


def test_daemon_away_at_start_and_restarted_mid_run(model_and_ref, tmp_path: Path) -> None:
    """vLLM starts with no daemon; stores begin when it appears and resume after a restart."""
    model, ref = model_and_ref
    a = scenario_prompts()["away"]
    d = DaemonCtl(tmp_path / "k.sock")
    seen: dict[str, Any] = {}

    def up() -> None:
        d.start()
        time.sleep(2.5)  # longer than the worker's longest back-off

    def down_and_count() -> None:
        seen["before"] = json.loads((tmp_path / "away.stats.json").read_text())
        d.stop()

    try:
        phases = [[a["A"]], [a["B"]], [a["C2"]], [a["D"]]]
        got = run_engine(tmp_path, "away", model, phases, kv_config(d.address, tmp_path, "away"),
                         on_pause={0: up, 1: down_and_count, 2: up})
        assert mismatches([p[0] for p in phases], got, ref) == []
        st = stats(tmp_path, "away")
        assert seen["before"]["stored_blocks"] >= 3  # B's blocks, once the daemon appeared
        assert st["stored_blocks"] >= seen["before"]["stored_blocks"] + 3, (seen, st)  # D's
        assert st["attaches"] == 2 and st["outages"] >= 2, st
        got = run_engine(tmp_path, "after", model, [[a["D2"]]],
                         kv_config(d.address, tmp_path, "after"))
        assert mismatches([a["D2"]], got, ref) == []
        assert stats(tmp_path, "after")["loaded_blocks"] == 3
    finally:
        d.stop()
