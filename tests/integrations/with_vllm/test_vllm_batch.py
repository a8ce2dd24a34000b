"""vLLM with the async connector under load: batched prompts with partial overlaps and odd
lengths in a KV cache small enough that vLLM preempts running requests, token for token against
vLLM without the connector (each prompt alone).

Loads and stores of different requests share steps, stores are still in flight when vLLM
preempts a request and reuses its blocks (the connector must wait for them first), finished
requests keep their blocks until their stores end, and a second batch loads what the first
stored, layer by layer.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tiny_model import TinyShape, build_tiny_llama
from vllm_harness import kv_config, mismatches, reference, run_engine, stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

SHAPE = TinyShape(layers=3, hidden=192, heads=6, kv_heads=3, intermediate=256)
BLOCK = 32
GPU_BLOCKS = 20  # max_model_len 512 = 16 blocks; four running requests need ~36


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    base = [rng.randrange(4, 512) for _ in range(300)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(4, 512) for _ in range(n)]

    return [base[:37] + tail(164), base[:101] + tail(132), base[:150] + tail(107),
            base[:64] + tail(155), base[:233] + tail(12), tail(190), base[:201] + tail(45)]


def test_batched_overlapping_prompts_with_preemption(daemon_factory, tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model", SHAPE)
    ps = prompts()
    ref = reference(tmp_path, model, ps, block=BLOCK, max_tokens=40)
    address = daemon_factory(cpu_gb=0.25)
    got = run_engine(tmp_path, "batch", model, [ps, ps], kv_config(address, tmp_path, "batch"),
                     block=BLOCK, max_tokens=40, batch=True, gpu_blocks=GPU_BLOCKS)
    assert mismatches(ps + ps, got, ref) == []
    st = stats(tmp_path, "batch")
    assert st["preemption_flushes"] > 0, st  # vLLM did preempt, and the stores were waited for
    assert st["stored_blocks"] > 0 and st["loaded_blocks"] > 0, st  # the second batch loaded
    assert st["load_failed_blocks"] == 0, st
    got = run_engine(tmp_path, "fresh", model, [ps], kv_config(address, tmp_path, "fresh"),
                     block=BLOCK, max_tokens=40, batch=True, gpu_blocks=GPU_BLOCKS)
    assert mismatches(ps, got, ref) == []
    assert stats(tmp_path, "fresh")["loaded_blocks"] > 0
