"""What a cache entry is, seen through vLLM: new weights at one path, LoRA adapters, TP ranks.

Every output is compared token for token with vLLM without the connector (each prompt alone).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiny_model import TinyShape, build_tiny_llama, build_tiny_lora
from vllm_harness import DaemonCtl, kv_config, mismatches, reference, run_engine, stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]  # engines start slowly

MHA = TinyShape(layers=5, hidden=128, heads=4, kv_heads=4, intermediate=256)  # 4 heads x 32
GQA = TinyShape(layers=3, hidden=512, heads=8, kv_heads=2, intermediate=512)  # 8:2 heads x 64


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(n)]


def shared_prompts(seed: int, shared: int) -> tuple[list[int], list[int], list[int]]:
    """A (``shared`` + 10 tokens), B and B2 sharing A's first ``shared`` tokens."""
    rng = random.Random(seed)
    a = toks(rng, shared + 10)
    return a, a[:shared] + toks(rng, 25), a[:shared] + toks(rng, 40)


def test_new_weights_at_the_same_path_miss(tmp_path: Path) -> None:
    """Block size 64: KV stored under old weights is never loaded for new weights."""
    model = build_tiny_llama(tmp_path / "model", MHA, seed=0)
    a, b, b2 = shared_prompts(11, 128)
    d = DaemonCtl(tmp_path / "k.sock")
    d.start()
    try:
        run_engine(tmp_path, "old", model, [[a]], kv_config(d.address, tmp_path, "old"),
                   block=64)
        assert stats(tmp_path, "old")["stored_blocks"] == 2
        build_tiny_llama(tmp_path / "model", MHA, seed=1)  # new weights, same path
        ref = reference(tmp_path, model, [b, b2], block=64)
        got = run_engine(tmp_path, "new", model, [[b], [b2]],
                         kv_config(d.address, tmp_path, "new"), block=64)
        assert mismatches([b, b2], got, ref) == []
        # Nothing of the old weights; B2 loads what B stored under the new ones.
        assert stats(tmp_path, "new")["loaded_blocks"] == 2
    finally:
        d.stop()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lora")
    model = build_tiny_llama(tmp / "model", GQA)
    loras = {"l1": str(build_tiny_lora(tmp / "l1", GQA, seed=1)),
             "l2": str(build_tiny_lora(tmp / "l2", GQA, seed=2))}
    a, b, _ = shared_prompts(12, 90)
    prompts = [{"ids": b}, {"ids": b, "lora": "l1"}, {"ids": b, "lora": "l2"},
               {"ids": b, "salt": "s1"}, {"ids": b, "salt": "s2"}]
    return {"model": model, "loras": loras, "a": a, "b": b, "prompts": prompts,
            "ref": reference(tmp, model, prompts, loras=loras)}


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-on", "prefix-off"])
def test_lora_never_gets_another_adapters_kv(lora_setup, prefix_caching: bool,
                                             tmp_path: Path) -> None:
    """LoRA adapters and cache_salt are in the key whether vLLM's prefix caching is on or off."""
    s = lora_setup
    d = DaemonCtl(tmp_path / "k.sock")
    d.start()
    try:
        extra = {"loras": s["loras"], "prefix_caching": prefix_caching}
        stored = [{"ids": s["a"]}, {"ids": s["a"], "lora": "l1"}, {"ids": s["a"], "salt": "s1"}]
        run_engine(tmp_path, "store", s["model"], [[p] for p in stored],
                   kv_config(d.address, tmp_path, "store"), **extra)
        prompts = s["prompts"]
        got = run_engine(tmp_path, "load", s["model"], [[p] for p in prompts],
                         kv_config(d.address, tmp_path, "load"), **extra)
        assert mismatches(prompts, got, s["ref"]) == []
        # B loads A's 2 blocks under the same adapter or salt only: base, l1, s1 (not l2, s2).
        assert stats(tmp_path, "load")["loaded_blocks"] == 6
    finally:
        d.stop()


def test_tensor_parallel_two_ranks(tmp_path: Path) -> None:
    """TP=2 in both passes: each rank loads its own KV heads, and only prefixes both hold."""
    model = build_tiny_llama(tmp_path / "model", GQA)
    a, b, b2 = shared_prompts(13, 90)
    ref = reference(tmp_path, model, [b, b2], tp=2)
    d = DaemonCtl(tmp_path / "k.sock")
    d.start()
    try:
        run_engine(tmp_path, "store", model, [[a]], kv_config(d.address, tmp_path, "store"),
                   tp=2)
        got = run_engine(tmp_path, "load", model, [[b], [b2]],
                         kv_config(d.address, tmp_path, "load"), tp=2)
        assert mismatches([b, b2], got, ref) == []
        for rank in (0, 1):
            assert stats(tmp_path, "load", rank)["loaded_blocks"] == 4, rank
    finally:
        d.stop()
