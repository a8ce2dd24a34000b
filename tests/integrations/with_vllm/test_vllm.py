"""vLLM with the kvtier connector: a second engine loads the shared prefix and decodes the same.

Each engine runs in a process of its own (``vllm_harness.run_engine``) against a real daemon
subprocess on the CPU device. The reference is the same engine without the connector, with its
prefix cache reset between prompts. Counts of loaded blocks come from the connector's own stats
file.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiny_model import TinyShape, build_tiny_llama
from vllm_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32  # the smallest block size vLLM's CPU attention accepts
SHAPES = {
    "gqa-2layers": TinyShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256),
    "mqa-4layers": TinyShape(layers=4, hidden=256, heads=4, kv_heads=1, intermediate=256),
}


def prompts() -> dict[str, list[int]]:
    """A: 100 tokens. B shares A's first 90 (2 full blocks); C extends A (3 full blocks)."""
    rng = random.Random(0)
    a = [rng.randrange(4, 512) for _ in range(100)]
    return {"A": a, "B": a[:90] + [rng.randrange(4, 512) for _ in range(30)],
            "C": a + [rng.randrange(4, 512) for _ in range(45)]}


def kv_config(address: str, tmp: Path, name: str) -> dict[str, Any]:
    return {"address": address, "tenant": "it", "stats_file": str(tmp / f"{name}.stats.json")}


def stats(tmp: Path, name: str) -> dict[str, int]:
    return json.loads((tmp / f"{name}.stats.json").read_text())


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list]]:
    """Per shape: the model folder and the outputs for B and C without kvtier."""
    p = prompts()
    out = {}
    for name, shape in SHAPES.items():
        tmp = tmp_path_factory.mktemp(name)
        model = build_tiny_llama(tmp / "model", shape)
        out[name] = (model, run_engine(tmp, "ref", model, [[p["B"]], [p["C"]]]))
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_second_engine_loads_prefix_from_cpu(shape: str, references, daemon_factory,
                                             tmp_path: Path) -> None:
    model, expected = references[shape]
    p = prompts()
    address = daemon_factory(cpu_gb=0.25)
    run_engine(tmp_path, "first", model, [[p["A"]]], kv_config(address, tmp_path, "first"))
    assert stats(tmp_path, "first")["stored_blocks"] == 3  # 100 prompt + 7 output tokens
    got = run_engine(tmp_path, "second", model, [[p["B"]], [p["C"]]],
                     kv_config(address, tmp_path, "second"))
    assert got == expected
    s = stats(tmp_path, "second")
    assert s["loaded_blocks"] * BLOCK == 64 + 96 and s["load_failed_blocks"] == 0


def test_prefix_loaded_from_disk(references, daemon_factory, tmp_path: Path) -> None:
    from kvtier.client import connect

    model, expected = references["gqa-2layers"]
    p = prompts()
    rng = random.Random(1)
    fillers = [[rng.randrange(4, 512) for _ in range(300)] for _ in range(6)]
    # 1 MiB of CPU pages (32 pages of 32 KiB): the fillers push A's blocks down to disk.
    address = daemon_factory(cpu_gb=1 / 1024, disk=tmp_path / "disk")
    run_engine(tmp_path, "first", model, [[p["A"]], fillers], kv_config(address, tmp_path, "f"))
    got = run_engine(tmp_path, "second", model, [[p["B"]], [p["C"]]],
                     kv_config(address, tmp_path, "second"))
    assert got == expected
    assert stats(tmp_path, "second")["loaded_blocks"] * BLOCK == 64 + 96
    with connect(address, tenant="it") as client:
        reply = client.stats(whole=True)
    hits = {k.lower(): v for k, v in reply.hits.items()}
    assert hits.get("disk", 0) > 0, reply


def test_corrupt_pages_are_recomputed(references, daemon_factory, tmp_path: Path) -> None:
    """Stored blocks whose bytes rot on disk fail to load; vLLM recomputes them: same output."""
    model, expected = references["gqa-2layers"]
    p = prompts()
    rng = random.Random(1)
    fillers = [[rng.randrange(4, 512) for _ in range(300)] for _ in range(6)]
    disk = tmp_path / "disk"
    address = daemon_factory(cpu_gb=1 / 1024, disk=disk)
    run_engine(tmp_path, "first", model, [[p["A"]], fillers], kv_config(address, tmp_path, "f"))
    for data in disk.glob("pages-*.dat"):
        with open(data, "r+b") as fh:
            fh.write(os.urandom(data.stat().st_size))
    got = run_engine(tmp_path, "second", model, [[p["B"]], [p["C"]]],
                     kv_config(address, tmp_path, "second"))
    assert got == expected
    s = stats(tmp_path, "second")
    assert s["load_failed_blocks"] > 0 and s["loaded_blocks"] * BLOCK < 64 + 96
