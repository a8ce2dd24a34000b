"""Multi-turn modes whose KV is stored per layer group (used by ``benchmarks/multiturn.py``).

- ``kvtier-cpu-overlap``: the prefix restored group by group just before each group's stage of
  the prefill (``LayerGroupStore.first_token`` over a ``StagedPrefill``, one captured graph per
  stage on CUDA): the copy of group g+1 overlaps the compute of group g.
- ``kvtier-disk-race``: a CPU budget too small for the trace (prefixes come from disk). A prefix
  held on the CPU tier (or the GPU) is restored as above ("overlap"); one with any block on disk
  is raced against recomputing the prompt (``RacedRestore``): "race won@i" when the load landed
  before layer i and layers i.. ran over the new tokens only, "race lost" when the recompute
  finished first, "none" when nothing was stored.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvtier import OffloadConfig, Tier, TierEngine
from kvtier.integrations.transformers.overlap import LayerGroupStore
from kvtier.integrations.transformers.race import RacedRestore
from kvtier.integrations.transformers.staged import StagedPrefill


class GroupedKVTier:
    """One multi-turn mode over layer-group pages (see the module docstring)."""

    restore_s = 0.0  # restore and prefill are interleaved: not measured apart
    choice = ""

    def __init__(self, name: str, model: Any, config: OffloadConfig, args: Any, *,
                 race: bool, user: int) -> None:
        self.name, self.model = name, model
        bs, dtype = args.block_size, next(model.parameters()).dtype
        self.engine = TierEngine(config)
        try:
            self.prefill = StagedPrefill(model, args.max_context + 4 * bs, step=args.step,
                                         kv_step=args.kv_step, groups=args.layer_groups)
            self.store = LayerGroupStore(
                self.engine, bounds=self.prefill.bounds, model=model, model_config=model.config,
                dtype=dtype, device=model.device, tenant="bench", block_size=bs,
                staging_slots=args.max_context // bs + 1)
        except BaseException:
            self.engine.close()
            raise
        # Capturing graphs is a start-up cost, not a per-turn one (as the other graph modes).
        suffixes = range(args.step, user + bs + args.step, args.step)
        self.graphs = self.prefill.prepare_staged(list(range(0, args.max_context, bs)),
                                                  list(suffixes))
        self.race = RacedRestore(self.store, self.prefill) if race else None
        self.races: Counter[str] = Counter()

    def ttft(self, conv: int, prompt: list[int]) -> tuple[int, int]:
        if self.race is None:
            return self.store.first_token(self.prefill, prompt)
        bs = self.store.block_size
        tiers = self.store.tiers(prompt)[: self.prefill.capacity // bs]
        if tiers and max(tiers) <= Tier.CPU:
            self.choice = "overlap"
            return self.store.first_token(self.prefill, prompt)
        out = self.race.first_token(prompt, len(tiers) * bs)
        if not tiers:
            self.choice = "none"
        else:
            self.choice = f"race won@{out.switched_at}" if out.won else "race lost"
            self.races["won" if out.won else "lost"] += 1
        return out.restored, out.token

    def after(self, conv: int, prompt: list[int], reply: list[int]) -> None:
        if self.race is not None:
            self.race.join()  # a lost race's load finishes off the clock
        self.prefill.extend(prompt + reply, len(prompt))  # the reply's KV, as decoding leaves it
        self.store.save(self.prefill.kv, prompt + reply, wait_s=5.0)

    def close(self) -> None:
        try:
            if self.race is not None:
                self.race.join()
        finally:
            counters = self.store.stores[0].counters  # every group restores the same blocks
            self.restored_from = {t.name.lower(): n for t, n in counters.restored_from.items()}
            self.store.close()
            self.engine.close()
