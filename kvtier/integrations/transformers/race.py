"""A slow tier's load raced against recomputing the prompt (experimental).

Exact, but not faster yet: on a lent H100 (2026-11-24, ``benchmarks/multiturn.py`` mode
``kvtier-disk-race``) it was slower than the reference recompute in 45 of 64 turns: its own
layer-by-layer recompute (with a host check per layer) and the load's thread cost more than the
races it wins (17 of 47).

A planner's costs come from past loads, so it can't see a slow disk read coming (a cold file, a
busy device). :class:`RacedRestore` does not guess: it starts the load of the stored prefix on a
thread and recomputes the whole prompt at once, layer by layer; before each layer it checks (a
flag, no wait) whether the prefix of that layer's group and of every later group has landed. If
so it switches: the landed KV is copied into ``kv`` for the layers left (on the current stream,
after the load thread's copy event) and only the prompt's positions past the prefix run through
the remaining layers, starting from the recompute's own hidden states of those positions (the
same values the restore path would compute, so the KV and the token are exact). Otherwise the
recompute simply finishes. Switching always beats finishing once landed (fewer positions through
the same layers; the copy is a device copy far below a layer's compute), so it is never refused.

- ``RacedRestore(groups, prefill)``: over a :class:`~.overlap.LayerGroupStore` and a
  :class:`~.staged.StagedPrefill` with the same layer groups.
- ``first_token(token_ids, cut) -> Outcome``: race the load of the first ``cut`` tokens (whole
  stored blocks; 0: recompute without a race). ``Outcome``: restored tokens, the token, the
  layer the switch happened before (``None``: the recompute finished).
- ``join()``: wait for the load thread (its bytes land in a scratch buffer, never in ``kv``);
  call it before the store is used again (``first_token`` does so itself).

The load thread loads the groups last first (a switch before a layer of group ``g`` needs groups
``g..``). On CUDA, after launching layer ``i`` the host waits for layer ``i - 2`` to finish, so
the check before layer ``i + 1`` sees how far the GPU has got, with two layers always queued
(the GPU does not wait for the host). Loads land in a scratch buffer of the prefix's size.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from .overlap import LayerGroupStore
from .staged import StagedPrefill


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a raced turn did."""

    restored: int  # tokens of the prompt whose KV came from the load (0: all recomputed)
    token: int  # the greedy next token
    switched_at: int | None  # the layer the switch happened before; None: no switch

    @property
    def won(self) -> bool:
        return self.switched_at is not None


class _Loader(threading.Thread):
    """Loads each group's prefix into ``scratch``, last group first; records what landed."""

    def __init__(self, groups: LayerGroupStore, scratch: torch.Tensor, token_ids: list[int],
                 cut: int, stream: Any) -> None:
        super().__init__(name="kvtier-race-load", daemon=True)
        self.groups, self.scratch, self.ids, self.cut, self.stream = (
            groups, scratch, token_ids, cut, stream)
        n = len(groups.stores)
        self.tokens = [0] * n  # tokens landed per group
        self.events: list[Any] = [None] * n  # the copy of each group into scratch
        self.landed = [False] * n
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for g in reversed(range(len(self.groups.stores))):
                self._load(g)
        except BaseException as exc:  # the recompute goes on; the error is raised by join
            self.error = exc

    def _load(self, g: int) -> None:
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.tokens[g] = self.groups.restore_group(self.scratch, g, self.ids, self.cut)
                self.events[g] = torch.cuda.Event()
                self.events[g].record()
        else:
            self.tokens[g] = self.groups.restore_group(self.scratch, g, self.ids, self.cut)
        self.landed[g] = True

    def ready_from(self, g: int) -> int:
        """Tokens landed in every group from ``g`` on (0 unless all of them have landed)."""
        if not all(self.landed[g:]):
            return 0
        return min(self.tokens[g:])


class RacedRestore:
    """Race a load against the recompute (see the module docstring)."""

    def __init__(self, groups: LayerGroupStore, prefill: StagedPrefill) -> None:
        if prefill.bounds != groups.bounds:
            raise ValueError(f"prefill: layer groups {prefill.bounds} != the store's "
                             f"{groups.bounds}")
        self.groups, self.prefill = groups, prefill
        self.scratch = torch.empty_like(prefill.kv)
        cuda = prefill.kv.is_cuda
        self._stream = torch.cuda.Stream(prefill.kv.device) if cuda else None
        self._loader: _Loader | None = None

    def join(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.join()
            if loader.error is not None:
                raise loader.error

    def first_token(self, token_ids: list[int], cut: int) -> Outcome:
        """Recompute ``token_ids``, switching to the stored KV of its first ``cut`` tokens if
        that lands in time."""
        self.join()
        ids, sp = list(token_ids), self.prefill
        if len(ids) > sp.capacity or not 0 <= cut < len(ids):
            raise ValueError(f"token_ids/cut: need 0 <= cut < {len(ids)} tokens <= the capacity "
                             f"of {sp.capacity}, got cut {cut}")
        loader = None
        if cut:
            if self._stream is not None:  # scratch is free once what read it last has run
                self._stream.wait_stream(torch.cuda.current_stream(sp.kv.device))
            loader = self._loader = _Loader(self.groups, self.scratch, ids, cut, self._stream)
            loader.start()
        x = torch.tensor([ids], device=sp.device)
        pos = torch.arange(len(ids), device=sp.device)
        hidden = sp.head(x)
        emb = sp.rotary(hidden, pos)
        done: list[Any] = []
        for i in range(sp.kv.shape[0]):
            if loader is not None and (landed := self._landed(loader, i)):
                return self._switch(i, hidden, pos, landed, loader)
            hidden = sp.run_layers(hidden, pos, len(ids), range(i, i + 1), emb)
            if self._stream is not None:
                done.append(torch.cuda.Event())
                done[-1].record()
                if i >= 2:
                    done[i - 2].synchronize()  # the host keeps two layers ahead of the GPU
        return Outcome(0, int(sp.tail(hidden)[-1].item()), None)

    def _group(self, layer: int) -> int:
        """The layer group holding ``layer``."""
        return max(g for g in range(self.prefill.groups) if self.prefill.bounds[g] <= layer)

    def _landed(self, loader: _Loader, layer: int) -> int:
        """Tokens to switch to before ``layer`` (0: go on recomputing); a check, no wait."""
        return loader.ready_from(self._group(layer))

    def _switch(self, layer: int, hidden: torch.Tensor, pos: torch.Tensor, landed: int,
                loader: _Loader) -> Outcome:
        """Layers ``layer..`` over the positions past the landed prefix, with the landed KV."""
        sp, n = self.prefill, len(pos)
        current = torch.cuda.current_stream(sp.kv.device) if self._stream is not None else None
        for h in range(self._group(layer), sp.groups):
            if current is not None:
                current.wait_event(loader.events[h])
            a, b = max(layer, sp.bounds[h]), sp.bounds[h + 1]
            sp.kv[a:b, :, :, :landed].copy_(self.scratch[a:b, :, :, :landed], non_blocking=True)
        rest, at = hidden[:, landed:], pos[landed:]
        rest = sp.run_layers(rest, at, n, range(layer, sp.kv.shape[0]))
        return Outcome(landed, int(sp.tail(rest)[-1].item()), layer)
