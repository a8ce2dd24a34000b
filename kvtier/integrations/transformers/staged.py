"""A static prefill run in layer groups, so a restore can land layer group by layer group.

:class:`StagedPrefill` is a :class:`~.static.StaticPrefill` whose forward is cut into ``groups``
runs of consecutive decoder layers (``bounds[g]`` to ``bounds[g + 1]``):

- ``first_token_staged(token_ids, start, before) -> int``: what ``first_token`` returns, but
  ``before(g)`` is called on the host before stage ``g`` is launched, and stage ``g`` only reads
  (and writes) layers ``bounds[g]:bounds[g + 1]`` of ``kv``. So ``before(g)`` may be the restore
  of those layers' prefix: whatever it enqueues on the current stream runs before stage ``g``,
  while the stages already launched keep the GPU busy. ``before`` may raise: nothing after it
  is launched and the exception propagates.
- On CUDA each stage of each (suffix, kv) shape is one captured graph (the embedding in the first,
  the norm, head and greedy token in the last); elsewhere the same stages run eagerly.
- ``run_layers(hidden, pos, kv_len, layers, emb=None)``: eager layers over any hidden states
  (e.g. the suffix rows of a recompute that is switched to restored KV half way; see ``race``);
  ``rotary(hidden, pos)``, ``head(ids)`` and ``tail(hidden)``: the pieces around the layers.

Exactness: every stage runs the same modules on the same inputs as the unstaged forward, so the
tokens (and the KV written) equal ``first_token``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .static import ATTENTION, StaticPrefill, _StaticKV


@dataclass(slots=True)
class _Stages:
    """Static inputs, hand-offs and outputs of one (suffix, kv) shape; its graphs once captured."""

    ids: torch.Tensor  # [1, S] token ids (padded)
    pos: torch.Tensor  # [S] positions start..start+S-1
    hidden: torch.Tensor  # [1, S, hidden] between stages
    cos: torch.Tensor  # rotary embeddings of pos
    sin: torch.Tensor
    tokens: torch.Tensor  # [S] greedy next token after each position (output)
    graphs: list[Any] = field(default_factory=list)


class StagedPrefill(StaticPrefill):
    """``StaticPrefill`` cut into layer groups (see the module docstring)."""

    def __init__(self, model: Any, capacity: int, *, groups: int = 4, **kwargs: Any) -> None:
        super().__init__(model, capacity, **kwargs)
        layers = self.kv.shape[0]
        if not 1 <= groups <= layers:
            raise ValueError(f"groups: need 1 <= groups <= {layers} layers, got {groups}")
        self.bounds = [layers * g // groups for g in range(groups + 1)]
        self._stages: dict[tuple[int, int], _Stages] = {}

    @property
    def groups(self) -> int:
        return len(self.bounds) - 1

    def first_token_staged(self, token_ids: list[int], start: int,
                           before: Callable[[int], None]) -> int:
        """Prefill ``token_ids[start:]`` stage by stage, ``before(g)`` ahead of stage ``g``."""
        n, s, kv_len = self._checked_shape(token_ids, start)
        st = self._staged_bucket(s, kv_len)
        st.ids.copy_(torch.tensor([[*token_ids[start:], *[0] * (s - n)]], dtype=torch.long))
        torch.arange(start, start + s, out=st.pos)
        for g in range(self.groups):
            before(g)
            if st.graphs:
                st.graphs[g].replay()
            else:
                self._stage(st, g, self.kv, kv_len)
        return int(st.tokens[n - 1].item())

    def prepare_staged(self, starts: list[int], lengths: list[int]) -> int:
        """Capture ahead the stage graphs ``first_token_staged`` would need; how many shapes."""
        for start in starts:
            for n in lengths:
                s, kv_len = self._shape(start, n)
                if s + start <= self.capacity:
                    self._staged_bucket(s, kv_len)
        return sum(1 for st in self._stages.values() if st.graphs)

    def run_layers(self, hidden: torch.Tensor, pos: torch.Tensor, kv_len: int, layers: range,
                   emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Eagerly run ``layers`` over ``hidden`` (``[1, S, hidden]`` at positions ``pos``),
        their KV written into ``kv`` at ``pos`` and attention over ``kv[:kv_len]``. ``emb``:
        ``rotary(hidden, pos)`` if already computed (else computed here)."""
        if emb is None:
            emb = self.rotary(hidden, pos)
        with self._attention_impl(), torch.no_grad():
            return self._layers(hidden, pos, emb, self.kv, kv_len, layers)

    def rotary(self, hidden: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embeddings (cos, sin) of positions ``pos`` for ``hidden``'s dtype."""
        with torch.no_grad():
            cos, sin = self.model.model.rotary_emb(hidden, pos[None])
        return cos, sin

    def head(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of ``ids`` (``[1, S]``): the input of layer 0."""
        with torch.no_grad():
            return self.model.model.embed_tokens(ids)

    def tail(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy next token after each position of the last layer's ``hidden``."""
        with torch.no_grad():
            return self.model.lm_head(self.model.model.norm(hidden))[0].argmax(-1)

    # --- stages ---------------------------------------------------------------------------------
    @contextmanager
    def _attention_impl(self) -> Iterator[None]:
        """The model's attention is this module's static one while inside."""
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = before

    def _mask(self, pos: torch.Tensor, kv_len: int) -> torch.Tensor | None:
        if self.kv_step is None:  # the last query sits at the last key: causal, lower right
            return None
        keys = torch.arange(kv_len, device=self.device)
        return (keys[None, :] <= pos[:, None])[None, None]

    def _layers(self, hidden: torch.Tensor, pos: torch.Tensor, emb: tuple[torch.Tensor, ...],
                kv: torch.Tensor, kv_len: int, layers: range) -> torch.Tensor:
        cache, mask = _StaticKV(kv, pos, kv_len), self._mask(pos, kv_len)
        for i in layers:
            hidden = self.model.model.layers[i](
                hidden, attention_mask=mask, position_ids=pos[None], past_key_values=cache,
                use_cache=True, position_embeddings=emb)
        return hidden

    def _stage(self, st: _Stages, g: int, kv: torch.Tensor, kv_len: int) -> None:
        """Stage ``g``: layers ``bounds[g]:bounds[g + 1]`` from ``st.hidden`` back into it (the
        first stage starts from the embedding, the last ends with the tokens)."""
        with self._attention_impl(), torch.no_grad():
            if g == 0:
                st.hidden.copy_(self.head(st.ids))
                cos, sin = self.model.model.rotary_emb(st.hidden, st.pos[None])
                st.cos.copy_(cos)
                st.sin.copy_(sin)
            layers = range(self.bounds[g], self.bounds[g + 1])
            st.hidden.copy_(self._layers(st.hidden, st.pos, (st.cos, st.sin), kv, kv_len, layers))
            if g == self.groups - 1:
                st.tokens.copy_(self.tail(st.hidden))

    def _staged_bucket(self, s: int, kv_len: int) -> _Stages:
        st = self._stages.get((s, kv_len))
        if st is None:
            z = dict(dtype=torch.long, device=self.device)
            ids, pos = torch.zeros(1, s, **z), torch.arange(s, **z)
            hidden = self.head(ids).clone()
            cos, sin = self.model.model.rotary_emb(hidden, pos[None])
            st = _Stages(ids, pos, hidden, cos.clone(), sin.clone(), torch.zeros(s, **z))
            self._stages[(s, kv_len)] = st
        if self.graphs and not st.graphs and self.captured < self.max_graphs:
            st.graphs = self._capture_stages(st, kv_len)
            self.captured += 1
        return st

    def _capture_stages(self, st: _Stages, kv_len: int) -> list[Any]:
        """Warm up on a scratch buffer (never the live ``kv``), then capture each stage."""
        scratch = torch.zeros_like(self.kv[:, :, :, :kv_len])
        torch.arange(kv_len - st.pos.numel(), kv_len, out=st.pos)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                for g in range(self.groups):
                    self._stage(st, g, scratch, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        del scratch
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graphs = []
        for g in range(self.groups):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._stage(st, g, self.kv, kv_len)
            graphs.append(graph)
        return graphs
