"""Engines the connector can't serve safely: it stays off and says so, and vLLM's tokens are its
own. A sliding-window model (vLLM frees a running request's blocks outside the window and hands
them to other requests): with the connector on, a probe driving vLLM step by step got 4 of 20
prompts different. Here the connector must say it is off (no stats, nothing stored), and every
token is vLLM's own."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from tiny_model import TinyShape, build_tiny_mistral
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm_harness import DaemonCtl, kv_config, mismatches, reference, run_engine

from kvtier.integrations.vllm.support import unsupported

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

SHAPE = TinyShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256)


def _config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=[f"l{i}"], kv_cache_spec=s) for i, s in enumerate(specs)])


def test_only_one_group_of_full_attention_is_served() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype="float32")
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype="float32",
                               sliding_window=64)
    assert unsupported(_config(full)) is None
    assert unsupported(None) is None  # nothing to tell by
    assert "SlidingWindowSpec" in (unsupported(_config(window)) or "")
    assert "2 KV cache groups" in (unsupported(_config(full, window)) or "")


def test_a_sliding_window_model_runs_without_the_connector(tmp_path: Path) -> None:
    model = build_tiny_mistral(tmp_path / "model", SHAPE, window=64)
    rng = random.Random(8)
    bases = [[rng.randrange(4, 512) for _ in range(300)] for _ in range(4)]
    prompts = [b[:cut] + [rng.randrange(4, 512) for _ in range(rng.randrange(1, 40))]
               for b in bases for cut in (64, 128, 200, 299)] + bases
    ref = reference(tmp_path, model, prompts, max_tokens=48)
    d = DaemonCtl(tmp_path / "k.sock")
    d.start()
    try:
        got = run_engine(tmp_path, "sw", model, [prompts, prompts], max_tokens=48, batch=True,
                         kvtier=kv_config(d.address, tmp_path, "sw"))
    finally:
        d.stop()
    assert mismatches(prompts * 2, got, ref) == []
    assert not (tmp_path / "sw.stats.json").exists()  # nothing loaded or stored
