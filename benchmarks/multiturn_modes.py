"""The multi-turn benchmark's ways to serve a turn (``benchmarks/multiturn.py`` runs them).

``Mode.ttft`` is timed (restore + prefill of the new tokens + first token); ``Mode.after`` (the
reply's KV, saving) is not. ``Recompute``: prefill everything; ``KVTierEager``: restore into a
``DynamicCache``; ``KVTier``: ``restore_into`` a static buffer + captured graphs, with a load
planner optionally; ``KVTierLayered``: ``restore_layered`` + a staged prefill (overlapped);
``HFOffloaded``: transformers' offloaded cache.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, LlamaForCausalLM

from kvtier import OffloadConfig, Tier, TierEngine
from kvtier.integrations.transformers.cache import ConversationStore
from kvtier.integrations.transformers.staged import StagedPrefill
from kvtier.integrations.transformers.static import StaticPrefill
from kvtier.planner import LoadPlanner, PrefillModel, TierCost, measured_costs


def user_tokens(args: argparse.Namespace) -> int:
    return max(1, args.max_context // args.turns - args.reply_tokens)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_token(model: LlamaForCausalLM, ids: list[int], cache: DynamicCache) -> int:
    x = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax().item())


class Mode:
    """One way to serve a turn: ``ttft`` is timed; ``after`` (the reply's KV, saving) is not."""

    name = ""
    restore_s = 0.0  # set by ttft() when it restores a prefix
    choice = ""  # set by ttft() when a planner chose what to load

    def ttft(self, conv: int, prompt: list[int]) -> tuple[int, int]:
        """Return (tokens reused, first token)."""
        raise NotImplementedError

    def after(self, conv: int, prompt: list[int], reply: list[int]) -> None:
        return

    def close(self) -> None:
        return


class Recompute(Mode):
    name = "recompute"

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def ttft(self, conv: int, prompt: list[int]) -> tuple[int, int]:
        return 0, first_token(self.model, prompt, DynamicCache(config=self.model.config))


class RecomputeAgain(Recompute):
    """Recompute once more: with ``--paired``, each turn against the recompute just before it
    (the same work twice), so its ratios are the run's noise floor."""

    name = "recompute-again"


class KVTierEager(Mode):
    """Restore the prefix into a ``DynamicCache``, prefill eagerly, store prompt + reply."""

    def __init__(self, name: str, model: LlamaForCausalLM, config: OffloadConfig,
                 args: argparse.Namespace, dtype: torch.dtype, patient: bool = True) -> None:
        self.name, self.model = name, model
        self.engine = TierEngine(config)
        self.store = ConversationStore(
            self.engine, tenant="bench", model=model, model_config=model.config, dtype=dtype,
            device=model.device, block_size=args.block_size,
            staging_slots=args.max_context // args.block_size + 1, patient=patient)
        self._cache: DynamicCache | None = None

    def ttft(self, conv: int, prompt: list[int]) -> tuple[int, int]:
        start = time.perf_counter()
        cache = self.store.restore(prompt)
        sync(self.model.device)
        self.restore_s = time.perf_counter() - start
        n = cache.restored_tokens
        tok = first_token(self.model, prompt[n:], cache)
        self._cache = cache
        return n, tok

    def after(self, conv: int, prompt: list[int], reply: list[int]) -> None:
        assert self._cache is not None
        first_token(self.model, reply, self._cache)  # the reply's KV, as decoding leaves it
        self.store.save(self._cache, prompt + reply, wait_s=5.0)
        self._cache = None

    def close(self) -> None:
        counters = self.store.counters
        self.restored_from = {t.name.lower(): n for t, n in counters.restored_from.items()}
        self.store.close()
        self.engine.close()


class KVTier(KVTierEager):
    """Restore the prefix into a static KV buffer; prefill the rest from a captured CUDA graph."""

    def __init__(self, name: str, model: LlamaForCausalLM, config: OffloadConfig,
                 args: argparse.Namespace, dtype: torch.dtype, patient: bool = True) -> None:
        super().__init__(name, model, config, args, dtype, patient)
        self.prefill = self.make_prefill(model, args)
        # Capture the graphs of every (block-aligned prefix, suffix bucket) the trace can hit
        # before timing: capturing is a start-up cost, not a per-turn one.
        user = user_tokens(args)
        suffixes = range(args.step, user + args.block_size + args.step, args.step)
        self.graphs = self.capture(list(range(0, args.max_context, args.block_size)),
                                   list(suffixes))

        self.planner: LoadPlanner | None = None
        self._recomputed: DynamicCache | None = None  # a turn the planner left to recompute
        self.graph_suffix = user + args.block_size  # longest suffix with captured graphs

    def make_prefill(self, model: LlamaForCausalLM, args: argparse.Namespace) -> StaticPrefill:
        return StaticPrefill(model, args.max_context + 4 * args.block_size, step=args.step,
                             kv_step=args.kv_step)

    def capture(self, starts: list[int], suffixes: list[int]) -> int:
        return self.prefill.prepare(starts, suffixes)

    def plan_loads(self, prefill: PrefillModel) -> None:
        """Cost-aware loads from now on: the engine's measured throughput, ``prefill``'s rate."""
        cuda = self.model.device.type == "cuda"

        def costs() -> dict[Tier, TierCost]:
            moved = self.engine.stats().counters.moved
            rates = {d: m.bytes_per_s for d, m in moved.items()}
            return measured_costs(rates, cuda, {d: m.latency_s for d, m in moved.items()})

        from kvtier.client._backend import round_page

        page = round_page(self.store.layout.raw_bytes)  # the bytes a block moves
        # A plan is made under the engine lock (engine.borrow): the costs are read after each
        # turn (``after``), off the time to first token, not by the plan.
        self.planner = LoadPlanner(self.store.layout.block_size, page, prefill, costs,
                                   refresh_s=3600.0)
        self.planner.refresh()

    def ttft(self, conv: int, prompt: list[int]) -> tuple[int, int]:
        start = time.perf_counter()
        n = self.store.restore_into(self.prefill.kv, prompt, planner=self.planner)
        sync(self.model.device)
        self.restore_s = time.perf_counter() - start
        plan = self.store.last_plan
        self.choice = plan.choice if plan is not None else ""
        if self.store.last_cut:  # the wait for disk blocks ran out: fewer loaded than planned
            self.choice += " cut"
        if plan is not None and self.planner is not None:
            self.planner.observe(plan, self.restore_s)  # what a load costs beyond the bytes
        if len(prompt) - n <= self.graph_suffix:
            return n, self.prefill.first_token(prompt, n)
        return n, self.long_suffix(prompt, n)

    def long_suffix(self, prompt: list[int], n: int) -> int:
        """The first token of a prompt whose uncached suffix is longer than the captured graphs."""
        if n == 0:  # the plan recomputes it all: exactly what recompute runs (KV copied after)
            self._recomputed = DynamicCache(config=self.model.config)
            return first_token(self.model, prompt, self._recomputed)
        # Blocks left to recompute: eager; capturing a graph would be timed here.
        self.prefill.graphs, graphs = False, self.prefill.graphs
        try:
            return self.prefill.first_token(prompt, n)
        finally:
            self.prefill.graphs = graphs

    def after(self, conv: int, prompt: list[int], reply: list[int]) -> None:
        if self._recomputed is not None:  # the prompt's KV into the static buffer, untimed
            kv, n = self.prefill.kv, len(prompt)
            for i, layer in enumerate(self._recomputed.layers):
                kv[i, 0, :, :n] = layer.keys[0, :, :n]
                kv[i, 1, :, :n] = layer.values[0, :, :n]
            self._recomputed = None
        self.prefill.extend(prompt + reply, len(prompt))  # the reply's KV, as decoding leaves it
        self.store.save(self.prefill.kv, prompt + reply, wait_s=5.0)
        # Decoding the reply (hundreds of tokens, seconds) outlasts the moves the save set off
        # (a tight CPU tier demoting to disk: ~0.1 s): they are done before the next prompt.
        self.engine.wait_idle(10.0)
        if self.planner is not None:
            self.planner.refresh()


class KVTierLayered(KVTier):
    """The prefix borrowed from the CPU tier and copied layer group by layer group on a copy
    stream (``restore_layered``) while the staged prefill runs, each group's graph waiting for
    its own group's copy only (``StagedPrefill``, ``--layer-groups``)."""

    prefill: StagedPrefill

    def make_prefill(self, model: LlamaForCausalLM, args: argparse.Namespace) -> StagedPrefill:
        return StagedPrefill(model, args.max_context + 4 * args.block_size, step=args.step,
                             kv_step=args.kv_step, groups=args.layer_groups)

    def capture(self, starts: list[int], suffixes: list[int]) -> int:
        return self.prefill.prepare_staged(starts, suffixes)

    def ttft(self, conv: int, prompt: list[int]) -> tuple[int, int]:
        start = time.perf_counter()
        restore = self.store.restore_layered(self.prefill.kv, prompt, self.prefill.bounds,
                                             planner=self.planner)
        self.restore_s = time.perf_counter() - start  # issuing it: the copies run on
        plan = self.store.last_plan
        self.choice = plan.choice if plan is not None else ""
        n = restore.tokens
        try:
            if len(prompt) - n <= self.graph_suffix:
                return n, self.prefill.first_token_staged(prompt, n, restore.wait)
            restore.wait_all()
            return n, self.long_suffix(prompt, n)
        finally:
            restore.release()


class HFOffloaded(Mode):
    """transformers' layer-offloaded DynamicCache, one per conversation, kept across turns."""

    name = "hf-offloaded"

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.caches: dict[int, DynamicCache] = {}

    def ttft(self, conv: int, prompt: list[int]) -> tuple[int, int]:
        cache = self.caches.get(conv)
        if cache is None:
            cache = self.caches[conv] = DynamicCache(config=self.model.config, offloading=True)
        n = cache.get_seq_length()
        return n, first_token(self.model, prompt[n:], cache)

    def after(self, conv: int, prompt: list[int], reply: list[int]) -> None:
        first_token(self.model, reply, self.caches[conv])  # the reply's KV, as decoding leaves it
