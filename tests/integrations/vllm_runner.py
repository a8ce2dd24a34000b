"""Run one vLLM engine (a fresh process) over phases of prompts; write greedy outputs as JSON.

``python vllm_runner.py SPEC.json``. SPEC: ``model``, ``phases`` (lists of token-id prompts; the
prefix cache is reset between phases so later phases can only reuse KV through kvtier),
``max_tokens``, ``block_size``, ``out`` and optionally ``kvtier`` (connector extra config).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def engine_args(spec: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        model=spec["model"], dtype="float32", gpu_memory_utilization=0.1, max_model_len=1024,
        block_size=spec["block_size"], enforce_eager=True, seed=0, max_num_seqs=4,
    )
    if spec.get("kvtier"):
        args["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.client.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["kvtier"],
        }
    return args


def main(path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    with open(path, encoding="utf-8") as fh:
        spec = json.load(fh)
    llm = LLM(**engine_args(spec))
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    outputs = []
    for phase in spec["phases"]:
        llm.reset_prefix_cache()
        for prompt in phase:  # one at a time: later prompts of a phase may reuse earlier ones
            res = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            outputs.append(list(res[0].outputs[0].token_ids))
    with open(spec["out"], "w", encoding="utf-8") as fh:
        json.dump({"outputs": outputs}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
