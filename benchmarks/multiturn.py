"""Multi-turn chat benchmark: time to first token (TTFT) per turn, with and without kvtier.

Many conversations take turns round-robin; each turn appends the previous reply and a new user
message, so contexts grow to ``--max-context`` tokens. Only the active conversation's KV is on the
GPU; every other conversation's KV must come back from somewhere (the working set is many times
the GPU KV budget). Modes, all in one run on one model (a ~1B-param Llama with random bf16
weights; ``--tiny``: a small fp32 model on CPU as a smoke test):

- ``recompute``: prefill the whole context every turn (eager, SDPA flash causal attention: at 8K
  the GPU is the bottleneck, the Python launch overhead is hidden).
- ``kvtier-cpu``: restore the stored prefix from kvtier's pinned CPU tier straight into a static
  KV buffer (``ConversationStore.restore_into``), then prefill the new tokens with a captured
  CUDA graph (``kvtier.integrations.transformers.static.StaticPrefill``).
- ``kvtier-disk``: the same with a CPU budget too small for the trace, so prefixes come from disk,
  and cost-aware loads (``kvtier.planner``): per turn, only the leading stored blocks whose load
  (at the tiers' throughput the engine measured) beats recomputing them (at the prefill rate
  measured before the modes run) are loaded; the rest is prefilled. Each turn's choice (load,
  split, recompute) is reported, and whether this mode's TTFT ever exceeded recompute's.
- ``kvtier-disk-waits``: ``kvtier-disk`` whose planned loads wait for every disk block they
  planned (``ConversationStore(patient=False)``); ``kvtier-disk`` stops waiting once the plan's
  ``patience`` runs out and recomputes the rest. ``--contend-every N`` makes every Nth turn's disk
  busy with another reader (``multiturn_contend``): disk reads slower than the planner measured.
- ``kvtier-cpu-overlap``: the stored prefix borrowed in place from the CPU tier and copied layer
  group by layer group on a copy stream (``ConversationStore.restore_layered``) while the
  staged prefill runs, each group's graph waiting for its own group's copy only
  (``StagedPrefill``; ``--layer-groups``).
- ``kvtier-cpu-groupkeys`` / ``kvtier-disk-race`` (experimental): the KV stored per layer group
  under keys of its own, restored group by group (one engine load each) while the prefill runs,
  and (disk) a prefix with blocks on disk raced against the recompute (``multiturn_overlap``).
- ``kvtier-cpu-eager``: restore into a ``DynamicCache`` and prefill with transformers' eager
  forward (what the graph saves).
- ``hf-offloaded``: transformers' ``DynamicCache(offloading=True)`` kept per conversation (its
  layers wait in CPU memory between turns and are prefetched layer by layer).

TTFT = restore + prefill of the uncached suffix + first token on the host. A reply's KV is what
decoding produces: after each (untimed) turn, every mode that keeps KV computes the synthetic
reply's KV and keeps or stores it, so the next turn's suffix is the new user message plus the
tail of the last partial block. Writes ``results.json``, ``results.md`` and, if matplotlib is
installed, ``ttft.png`` under ``--out``.

    python benchmarks/multiturn.py --out results/multiturn            # GPU (H100), defaults
    python benchmarks/multiturn.py --tiny --out /tmp/multiturn        # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from multiturn_contend import Contender
from multiturn_modes import (
    HFOffloaded,
    KVTier,
    KVTierEager,
    KVTierLayered,
    Mode,
    Recompute,
    RecomputeAgain,
    first_token,
    sync,
    user_tokens,
)
from multiturn_overlap import GroupedKVTier
from multiturn_report import Turn, against_recompute, markdown, plot, same_tokens, summarize
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier import OffloadConfig
from kvtier.integrations.transformers.cache import KVLayout
from kvtier.planner import PrefillModel

GIB = 1024**3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--tiny", action="store_true", help="small fp32 model on CPU (smoke test)")
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--reply-tokens", type=int, default=None, help="synthetic reply per turn")
    p.add_argument("--disk-path", default="", help="disk tier folder (default: a temp dir)")
    p.add_argument("--modes",
                   default="recompute,kvtier-cpu,kvtier-cpu-overlap,kvtier-disk,"
                           "kvtier-cpu-groupkeys,kvtier-disk-race,kvtier-cpu-eager,hf-offloaded")
    p.add_argument("--layer-groups", type=int, default=None,
                   help="layer groups of the overlap and race modes (default 4; --tiny 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paired", action="store_true",
                   help="also recompute each turn's prompt just before every kvtier mode's turn "
                        "(the 'never above recompute' check then compares those pairs)")
    p.add_argument("--no-planner", action="store_true",
                   help="kvtier-disk loads every stored block (no cost-aware loads)")
    p.add_argument("--contend-every", type=int, default=0,
                   help="every Nth turn of the kvtier-disk modes, another reader keeps the disk "
                        "busy from just before the turn (multiturn_contend; 0: never)")
    p.add_argument("--contend-ms", type=float, default=300.0, help="how long each burst reads")
    p.add_argument("--step", type=int, default=128, help="graph bucket: suffix tokens")
    p.add_argument("--kv-step", type=int, default=None,
                   help="masked attention over multiples of this many positions (default: "
                        "exact lengths, flash attention, one graph per prefix length)")
    args = p.parse_args(argv)
    tiny = dict(conversations=3, turns=4, max_context=512, block_size=32, reply_tokens=96,
                layer_groups=2)
    full = dict(conversations=8, turns=16, max_context=8192, block_size=256, reply_tokens=384,
                layer_groups=4)
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def build_model(tiny: bool) -> tuple[LlamaForCausalLM, torch.device, torch.dtype]:
    """Random weights: ~1B params (16 layers, hidden 2048, GQA 32/8 heads) in bf16 on the GPU."""
    if tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024)
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the full benchmark needs a CUDA GPU; use --tiny on CPU")
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=16384)
        device, dtype = torch.device("cuda"), torch.bfloat16
    cfg.dtype = dtype
    torch.manual_seed(0)
    with device:
        model: Any = LlamaForCausalLM(cfg)
    return model.to(dtype).eval(), device, dtype


def make_trace(args: argparse.Namespace, vocab: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, per turn: (user tokens, reply tokens); contexts end at max_context."""
    g = torch.Generator().manual_seed(args.seed)
    user = user_tokens(args)
    rand = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [[(rand(user), rand(args.reply_tokens)) for _ in range(args.turns)]
            for _ in range(args.conversations)]


def timed_ttft(mode: Mode | GroupedKVTier, conv: int, prompt: list[int],
               device: torch.device) -> tuple[float, int, int]:
    """(seconds, tokens reused, first token) of one timed turn."""
    sync(device)
    start = time.perf_counter()
    reused, tok = mode.ttft(conv, prompt)
    sync(device)
    return time.perf_counter() - start, reused, tok


def run_mode(mode: Mode | GroupedKVTier, trace: list, device: torch.device,
             reference: Mode | None = None, busy: Callable[[int], bool] | None = None,
             contender: Contender | None = None, busy_s: float = 0.0) -> list[Turn]:
    """Every turn of ``trace`` through ``mode``; with ``reference`` (``--paired``), each turn's
    prompt is also recomputed just before the mode's turn, under the same machine state. Turns
    where ``busy(turn)`` have ``contender`` read the disk from just before the timed turn on."""
    rows: list[Turn] = []
    history: list[list[int]] = [[] for _ in trace]
    for t in range(len(trace[0])):
        for c, conv in enumerate(trace):
            user, reply = conv[t]
            prompt = history[c] + user
            ref = None if reference is None else timed_ttft(reference, c, prompt, device)[0]
            reader = contender if busy is not None and busy(t) else None
            if reader is not None:
                reader.burst(busy_s)
            took, reused, tok = timed_ttft(mode, c, prompt, device)
            if reader is not None:
                reader.join()
            choice = f"{mode.choice} (disk busy)" if reader is not None else mode.choice
            rows.append(Turn(mode.name, c, t, len(prompt), reused, took, tok, mode.restore_s,
                             choice, ref))
            mode.after(c, prompt, reply)
            history[c] = prompt + reply
    return rows


def kv_bytes_per_token(model: LlamaForCausalLM, dtype: torch.dtype) -> int:
    return KVLayout.of(model.config, 1, dtype).raw_bytes


def engine_config(args: argparse.Namespace, device: torch.device, page: int, *,
                  cpu_bytes: int, disk_path: str = "", disk_bytes: int = 0) -> OffloadConfig:
    slots = args.max_context // args.block_size + 1
    kw: dict[str, Any] = dict(
        device="cpu" if device.type == "cpu" else "cuda",
        gpu_memory_gb=page * (slots + 2) / GIB, cpu_memory_gb=cpu_bytes / GIB,
        pinned_chunk_mb=1 if args.tiny else 64, page_size=page)
    if disk_path:
        kw.update(disk_path=disk_path, disk_gb=max(1.0, disk_bytes / GIB),
                  disk_admission="always")
    return OffloadConfig(**kw)


def planned(mode: KVTier, prefill: PrefillModel | None) -> KVTier:
    if prefill is not None:
        mode.plan_loads(prefill)
    return mode


def measure_prefill(model: LlamaForCausalLM, args: argparse.Namespace,
                    device: torch.device) -> PrefillModel:
    """The model's prefill cost, fitted to whole eager prefills of an eighth to all of the
    longest context, six lengths (best of 5 each): what recomputing a prefix costs. (Three
    lengths for the fit's three terms fitted them exactly, noise included: one run's rate came
    out 12x too fast, and its planner never loaded.)"""
    g = torch.Generator().manual_seed(args.seed + 1)
    samples = []
    for n in [args.max_context * k // 8 for k in (1, 2, 3, 4, 6)] + [args.max_context - 1]:
        ids = torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist()
        best = float("inf")
        for _ in range(5):
            sync(device)
            start = time.perf_counter()
            first_token(model, ids, DynamicCache(config=model.config))
            sync(device)
            best = min(best, time.perf_counter() - start)
        samples.append((n, best))
    return PrefillModel.fit(samples)


def make_modes(args: argparse.Namespace, model: LlamaForCausalLM, device: torch.device,
               dtype: torch.dtype, disk_dir: str,
               prefill: PrefillModel | None = None) -> list[Callable[[], Mode | GroupedKVTier]]:
    """Mode constructors in run order (built one at a time so only one holds memory)."""
    from kvtier.client._backend import round_page

    page = round_page(KVLayout.of(model.config, args.block_size, dtype).raw_bytes)
    ctx_pages = args.max_context // args.block_size + 1
    roomy = page * ctx_pages * args.conversations * 2
    tight = page * ctx_pages  # one conversation: the others' prefixes live on disk
    # Each disk mode a folder of its own: a disk tier outlives its engine, and the next mode
    # would find every block of the trace already stored there.
    table: dict[str, Callable[[], Mode | GroupedKVTier]] = {
        "recompute": lambda: Recompute(model),
        "recompute-again": lambda: RecomputeAgain(model),
        "kvtier-cpu": lambda: KVTier("kvtier-cpu", model, engine_config(
            args, device, page, cpu_bytes=roomy), args, dtype),
        "kvtier-disk": lambda: planned(KVTier("kvtier-disk", model, engine_config(
            args, device, page, cpu_bytes=tight, disk_path=f"{disk_dir}/a", disk_bytes=roomy),
            args, dtype), prefill),
        "kvtier-disk-waits": lambda: planned(KVTier("kvtier-disk-waits", model, engine_config(
            args, device, page, cpu_bytes=tight, disk_path=f"{disk_dir}/b", disk_bytes=roomy),
            args, dtype, patient=False), prefill),
        "kvtier-cpu-overlap": lambda: KVTierLayered("kvtier-cpu-overlap", model, engine_config(
            args, device, page, cpu_bytes=roomy), args, dtype),
        "kvtier-cpu-groupkeys": lambda: GroupedKVTier("kvtier-cpu-groupkeys", model,
            engine_config(args, device, page, cpu_bytes=roomy), args, race=False,
            user=user_tokens(args)),
        "kvtier-disk-race": lambda: GroupedKVTier("kvtier-disk-race", model, engine_config(
            args, device, page, cpu_bytes=tight, disk_path=f"{disk_dir}/c", disk_bytes=roomy),
            args, race=True, user=user_tokens(args)),
        "kvtier-cpu-eager": lambda: KVTierEager("kvtier-cpu-eager", model, engine_config(
            args, device, page, cpu_bytes=roomy), args, dtype),
        "hf-offloaded": lambda: HFOffloaded(model),
    }
    return [table[m] for m in args.modes.split(",") if m]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # As `kvtier serve` and the transfer benchmark do: the engine's transfer threads get the GIL
    # within ~0.5 ms of a completed copy instead of up to 5 ms.
    sys.setswitchinterval(0.0005)
    args.out.mkdir(parents=True, exist_ok=True)
    model, device, dtype = build_model(args.tiny)
    trace = make_trace(args, model.config.vocab_size)
    rows: list[Turn] = []
    meta: dict[str, Any] = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        dtype=str(dtype).removeprefix("torch."), args={k: str(v) for k, v in vars(args).items()},
        params_m=sum(p.numel() for p in model.parameters()) / 1e6,
        kv_bytes_per_token=kv_bytes_per_token(model, dtype), restored_from={}, skipped={})
    with tempfile.TemporaryDirectory(dir=args.disk_path or None) as disk_dir:
        first_token(model, trace[0][0][0], DynamicCache(config=model.config))  # warm-up
        prefill = None if args.no_planner else measure_prefill(model, args, device)
        if prefill is not None:
            meta["prefill"] = dict(tokens_per_s=prefill.tokens_per_s,
                                   attention_s=prefill.attention_s)
        every = args.contend_every
        contender = Contender(disk_dir) if every > 0 else None
        busy = (lambda t: t % every == every - 1) if every > 0 else None
        for make in make_modes(args, model, device, dtype, disk_dir, prefill):
            mode = make()
            try:
                ref = Recompute(model) if args.paired and mode.name != "recompute" else None
                disky = contender if mode.name.startswith("kvtier-disk") else None
                rows += run_mode(mode, trace, device, ref, busy, disky, args.contend_ms / 1000)
            except Exception as exc:  # a baseline that doesn't apply here is reported, not fatal
                meta["skipped"][mode.name] = f"{type(exc).__name__}: {exc}"
            finally:
                mode.close()
                meta["restored_from"][mode.name] = getattr(mode, "restored_from", None)
                if getattr(mode, "races", None):
                    meta.setdefault("races", {})[mode.name] = dict(mode.races)
                if getattr(mode, "graphs", None):
                    meta.setdefault("graphs_captured", {})[mode.name] = mode.graphs
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if contender is not None:
            meta["contender_read_gib"] = round(contender.read_bytes / GIB, 2)
            contender.close()
    modes = list(dict.fromkeys(r.mode for r in rows))
    summary = summarize(rows, modes)
    meta["restored_from"] = {k: v for k, v in meta["restored_from"].items() if v}
    meta["same_tokens"] = same_tokens(rows)
    meta["against_recompute"] = {m: v for m in modes if m != "recompute"
                                 if (v := against_recompute(rows, m)) is not None}
    (args.out / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "turns": [asdict(r) for r in rows]}, indent=1))
    (args.out / "results.md").write_text(markdown(summary, modes, meta))
    plot(rows, modes, args.out / "ttft.png")
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
