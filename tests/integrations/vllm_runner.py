"""Run one vLLM engine (a fresh process) over phases of prompts; write greedy outputs as JSON.

``python vllm_runner.py SPEC.json``. SPEC: ``model``, ``phases`` (lists of prompts; the prefix
cache is reset between phases so later phases can only reuse KV through kvtier),
``max_tokens``, ``block_size``, ``out`` and optionally:

- ``kvtier``: connector extra config (no connector without it);
- a prompt is a list of token ids, or ``{"ids": [...], "lora": NAME, "salt": STR}``;
  ``loras``: ``{NAME: adapter folder}`` (enables LoRA);
- ``tp``: tensor-parallel size; ``prefix_caching``: ``false`` turns vLLM's prefix caching off;
- ``sync`` (a folder) and ``pause_after`` (phase indices): after such a phase the runner writes
  ``sync/paused-I`` and waits for ``sync/resume-I`` (the test restarts the daemon meanwhile).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def engine_args(spec: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        model=spec["model"], dtype="float32", gpu_memory_utilization=0.1, max_model_len=1024,
        block_size=spec["block_size"], enforce_eager=True, seed=0, max_num_seqs=4,
    )
    if spec.get("tp", 1) > 1:
        args.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    if spec.get("prefix_caching") is False:
        args["enable_prefix_caching"] = False
    if spec.get("gpu_blocks"):  # a small KV cache: running requests get preempted
        args.update(num_gpu_blocks_override=spec["gpu_blocks"], max_model_len=512)
    if spec.get("loras"):
        args.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if spec.get("kvtier"):
        args["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["kvtier"],
        }
    return args


def _pause(spec: dict[str, Any], phase: int, llm: Any) -> None:
    if phase not in spec.get("pause_after", ()):
        return
    # Settle first: the blocks are freed only once their stores have ended (and the counters
    # written), so what the test looks at during the pause is the phase's whole work.
    _reset_prefix_cache(llm)
    sync = Path(spec["sync"])
    (sync / f"paused-{phase}").touch()
    deadline = time.monotonic() + 300
    while not (sync / f"resume-{phase}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no resume-{phase}")
        time.sleep(0.1)


def _request(spec: dict[str, Any], prompt: Any) -> tuple[dict[str, Any], Any]:
    from vllm.lora.request import LoRARequest

    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}, None
    req: dict[str, Any] = {"prompt_token_ids": prompt["ids"]}
    if prompt.get("salt"):
        req["cache_salt"] = prompt["salt"]
    lora = None
    if prompt.get("lora"):
        names = sorted(spec["loras"])
        name = prompt["lora"]
        lora = LoRARequest(name, names.index(name) + 1, spec["loras"][name])
    return req, lora


def _reset_prefix_cache(llm: Any) -> None:
    """Empty vLLM's own prefix cache. With the connector's async stores a finished request's
    blocks stay held until its stores end (vLLM frees them once ``get_finished`` reports it, in
    a later engine step), and vLLM refuses to reset while any block is held: step the engine
    until they are freed. An in-process engine core only steps when asked; a background one
    steps by itself while requests wait for their stores."""
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM's prefix cache never emptied: blocks still held")
        if in_process:
            llm.llm_engine.step()
        time.sleep(0.01)


def main(path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    with open(path, encoding="utf-8") as fh:
        spec = json.load(fh)
    llm = LLM(**engine_args(spec))
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    outputs = []
    for i, phase in enumerate(spec["phases"]):
        _reset_prefix_cache(llm)
        if spec.get("batch"):  # the whole phase at once: loads and stores share steps
            reqs = [_request(spec, prompt)[0] for prompt in phase]
            res = llm.generate(reqs, params, use_tqdm=False)
            outputs.extend(list(r.outputs[0].token_ids) for r in res)
        else:
            for prompt in phase:  # one at a time: later prompts may reuse earlier ones
                req, lora = _request(spec, prompt)
                res = llm.generate([req], params, use_tqdm=False, lora_request=lora)
                outputs.append(list(res[0].outputs[0].token_ids))
        _pause(spec, i, llm)
    with open(spec["out"], "w", encoding="utf-8") as fh:
        json.dump({"outputs": outputs}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
