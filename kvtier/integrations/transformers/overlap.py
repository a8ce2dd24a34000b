"""A conversation's KV stored per layer group, restored group by group while the prefill runs
(experimental: exact, but on a lent H100 it reached 4.8x recompute at 7.8K tokens against 6.6x
for the whole-prefix ``restore_into``; four engine loads a turn cost more than the overlap saves).

A page of ``ConversationStore`` holds a block across all layers, so no layer of the prefill can
start before the whole prefix has landed (restore, then prefill). :class:`LayerGroupStore` keeps
one ``ConversationStore(layers=range(a, b))`` per layer group of a :class:`~.staged.StagedPrefill`
instead (its pages hold one block of those layers only; keys in a namespace per group), so:

- ``first_token(prefill, token_ids, planner=None) -> (restored tokens, token)``: restores group
  0's prefix, then runs the staged prefill; before stage ``g`` the prefix of group ``g`` is
  loaded (a blocking load on the host while the stages already launched run on the GPU) and
  copied into ``prefill.kv`` on the current stream, so stage ``g`` runs after it and the copy of
  group ``g + 1`` overlaps the compute of group ``g``. Restore + prefill ~ one group's load +
  max(the other loads, the compute) + the last group's compute. With a ``LoadPlanner`` only the
  leading blocks the plan loads are restored (``last_plan``). A group that restores fewer
  blocks than group 0 did (a block dropped or corrupt in between) ends the staged run: every
  group is then restored to the shortest prefix and the prefill runs again from there, so the
  result is exact either way.
- ``save(kv, token_ids, wait_s=0) -> int``: every group's blocks from a full ``kv`` buffer; the
  blocks stored in every group.
- ``lookup(token_ids) -> int``: tokens every group could restore now; ``tiers(token_ids)``: per
  block of that prefix, the slowest tier any group holds it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.planner import LoadPlanner, Plan
from kvtier.types import Tier

from .cache import ConversationStore, KVLayout
from .identity import of_model
from .layered import check_bounds
from .staged import StagedPrefill


class _Short(Exception):
    """A group restored fewer tokens than the staged run started from."""

    def __init__(self, group: int, tokens: int) -> None:
        super().__init__(f"group {group} restored {tokens} tokens")
        self.group, self.tokens = group, tokens


class LayerGroupStore:
    """One ``ConversationStore`` per layer group (see the module docstring)."""

    def __init__(self, target: Any, *, bounds: Sequence[int], model: torch.nn.Module | None = None,
                 model_config: Any = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, **kwargs: Any) -> None:
        model_config, dtype, device = of_model(model, model_config, dtype, device)
        layers = KVLayout.of(model_config, 1, dtype).layers
        self.bounds = b = check_bounds(bounds, layers)
        self.stores: list[ConversationStore] = []
        self.last_plan: Plan | None = None
        try:
            for g in range(len(b) - 1):
                self.stores.append(ConversationStore(
                    target, model=model, model_config=model_config, dtype=dtype, device=device,
                    layers=range(b[g], b[g + 1]), **kwargs))
        except BaseException:
            self.close()
            raise
        self.block_size = self.stores[0].layout.block_size

    def close(self) -> None:
        for st in self.stores:
            st.close()

    def __enter__(self) -> LayerGroupStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all groups (what loading it moves)."""
        return sum(st.layout.raw_bytes for st in self.stores)

    def group(self, kv: torch.Tensor, g: int) -> torch.Tensor:
        return kv[self.bounds[g] : self.bounds[g + 1]]

    def lookup(self, token_ids: Sequence[int]) -> int:
        return min(st.lookup(token_ids) for st in self.stores)

    def tiers(self, token_ids: Sequence[int]) -> list[Tier]:
        """Per block of the prefix every group holds, the slowest tier among the groups."""
        per = [st.stored_tiers(token_ids) for st in self.stores]
        n = min(len(t) for t in per)
        return [max(t[i] for t in per) for i in range(n)]

    def save(self, kv: torch.Tensor, token_ids: Sequence[int], *, wait_s: float = 0.0) -> int:
        return min(st.save(self.group(kv, g), token_ids, wait_s=wait_s)
                   for g, st in enumerate(self.stores))

    def restore_group(self, kv: torch.Tensor, g: int, token_ids: Sequence[int], cap: int) -> int:
        """Group ``g``'s stored prefix of ``token_ids``, at most ``cap`` tokens, into ``kv``."""
        upto = list(token_ids[: cap + 1])
        return self.stores[g].restore_into(self.group(kv, g), upto)

    def plan(self, token_ids: Sequence[int], capacity: int,
             planner: LoadPlanner | None) -> tuple[int, list[Tier]]:
        """How many tokens to restore (whole blocks, within ``capacity``) and the tiers."""
        tiers = self.tiers(token_ids)[: capacity // self.block_size]
        self.last_plan = None
        if planner is not None and tiers:
            self.last_plan = planner(tiers, len(token_ids))
            tiers = tiers[: self.last_plan.load]
        return len(tiers) * self.block_size, tiers

    def first_token(self, prefill: StagedPrefill, token_ids: Sequence[int], *,
                    planner: LoadPlanner | None = None) -> tuple[int, int]:
        """Restore overlapped with the staged prefill; (restored tokens, next greedy token)."""
        if prefill.bounds != self.bounds:
            raise ValueError(f"prefill: layer groups {prefill.bounds} != the store's "
                             f"{self.bounds}")
        ids, kv = list(token_ids), prefill.kv
        cap, _ = self.plan(ids, kv.shape[3], planner)
        n = self.restore_group(kv, 0, ids, cap) if cap else 0

        def before(g: int) -> None:
            if g and n:
                got = self.restore_group(kv, g, ids, n)
                if got < n:
                    raise _Short(g, got)

        try:
            return n, prefill.first_token_staged(ids, n, before)
        except _Short as short:
            m = short.tokens
            for g in range(short.group + 1, len(self.stores)):
                m = min(m, self.restore_group(kv, g, ids, m))
            return m, prefill.first_token(ids, m)
