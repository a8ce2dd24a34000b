"""Prefill over a preallocated KV buffer, replayed from captured CUDA graphs.

A restored prefix makes a turn's prefill short (the new user message over thousands of cached
tokens), and an eager transformers forward over a few hundred tokens costs more in Python and
kernel launches (~12 ms for 16 layers) than on the GPU. :class:`StaticPrefill` removes that:

- ``kv``: ``[layers, 2, kv_heads, capacity, head_dim]`` in the model's dtype on its device — what
  ``ConversationStore.restore_into`` fills and ``ConversationStore.save`` accepts.
- ``first_token(token_ids, start) -> int``: with positions ``[0, start)`` of ``kv`` holding the
  KV of ``token_ids[:start]``, computes the KV of ``token_ids[start:]`` into ``kv`` and returns
  the greedy next token. Positions past ``len(token_ids)`` may be overwritten (padding).
- ``extend(token_ids, start)``: the same without the token, eagerly (e.g. a reply's KV after
  decoding: off the latency path).
- ``prepare(starts, lengths)``: capture ahead the graphs ``first_token`` will replay.

The suffix is padded to a multiple of ``step`` tokens. By default attention reads ``kv[:start +
padded]`` with a causal mask aligned to the last key, so SDPA runs its flash kernel with grouped
KV heads read in place; a graph then serves one (prefix length, suffix bucket) pair, and prefixes
restored from kvtier are whole blocks, so there are at most ``capacity / block_size`` prefix
lengths per bucket (``max_graphs`` caps them; beyond it calls run eagerly). With ``kv_step`` set,
attention instead reads up to a multiple of ``kv_step`` positions under a boolean mask built on
the GPU (fewer graphs, a slower masked kernel). On CUDA graphs are captured on first use (or by
``prepare``) and replayed; elsewhere (or with ``graphs=False``) the same math runs eagerly.
Batch size 1. Works with Llama-style transformers models: attention modules that call
``past_key_values.update(key, value, layer_idx)`` and take their attention function from
``config._attn_implementation``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from .cache import KVLayout

ATTENTION = "kvtier_static"


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None,
               dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA with grouped KV heads read in place (no repeated K/V copy). Without a mask the last
    query sits at the last key (causal, lower-right aligned: flash kernels apply)."""
    mask = attention_mask
    if mask is None:
        mask = causal_lower_right(query.shape[2], key.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class _StaticKV:
    """The cache object the model sees: new K/V go to ``pos``; attention gets ``[0, kv_len)``."""

    def __init__(self, kv: torch.Tensor, pos: torch.Tensor, kv_len: int) -> None:
        self.kv, self.pos, self.kv_len = kv, pos, kv_len

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.kv[layer_idx, 0].unsqueeze(0)
        v = self.kv[layer_idx, 1].unsqueeze(0)
        k.index_copy_(2, self.pos, key.to(k.dtype))
        v.index_copy_(2, self.pos, value.to(v.dtype))
        return k[:, :, : self.kv_len], v[:, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


@dataclass(slots=True)
class _Bucket:
    """Static inputs and outputs of one (suffix, kv) shape, and its graph once captured."""

    ids: torch.Tensor  # [1, S] token ids (padded)
    pos: torch.Tensor  # [S] positions start..start+S-1
    tokens: torch.Tensor  # [S] greedy next token after each position (output)
    graph: Any = None


class StaticPrefill:
    """Short prefills over a static KV buffer, one CUDA graph per padded shape."""

    def __init__(self, model: Any, capacity: int, *, step: int = 128, kv_step: int | None = None,
                 graphs: bool | None = None, max_graphs: int = 256) -> None:
        if capacity <= 0 or step <= 0 or (kv_step is not None and kv_step <= 0):
            raise ValueError("capacity, step and kv_step must be positive")
        self.model = model
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        lay = KVLayout.of(model.config, 1, dtype)
        self.capacity, self.step, self.kv_step = capacity, step, kv_step
        self.kv = torch.zeros(lay.layers, 2, lay.kv_heads, capacity, lay.head_dim,
                              dtype=dtype, device=self.device)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.max_graphs = max_graphs
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool: Any = None
        self.captured = 0  # graphs captured so far (at most max_graphs)
        _register()

    def first_token(self, token_ids: list[int], start: int) -> int:
        """Prefill ``token_ids[start:]`` over the cached ``[0, start)``; the next greedy token."""
        b, n = self._run(token_ids, start, graph=self.graphs)
        return int(b.tokens[n - 1].item())

    def extend(self, token_ids: list[int], start: int) -> None:
        """Compute the KV of ``token_ids[start:]`` into ``kv``, eagerly (off the latency path:
        e.g. a reply's KV after decoding)."""
        self._run(token_ids, start, graph=False)

    def prepare(self, starts: list[int], lengths: list[int]) -> int:
        """Capture the graphs that ``first_token`` would need for these prefix lengths and
        suffix lengths ahead of time (capturing costs tens of ms); returns how many exist."""
        for start in starts:
            for n in lengths:
                shape = self._shape(start, n)
                if shape[0] + start <= self.capacity:
                    self._bucket(*shape, graph=self.graphs)
        return self.captured

    def _shape(self, start: int, n: int) -> tuple[int, int]:
        """(padded suffix, attended positions) of a prefill of ``n`` tokens after ``start``."""
        s = _round_up(n, self.step)
        if self.kv_step is None:  # exact: the last padded query sits at the last key
            return s, start + s
        return s, min(_round_up(start + s, self.kv_step), self.capacity)

    def _checked_shape(self, token_ids: list[int], start: int) -> tuple[int, int, int]:
        """(tokens, padded suffix, attended positions) of a prefill of ``token_ids[start:]``;
        ValueError naming the argument when it does not fit."""
        n = len(token_ids) - start
        if not 0 <= start < len(token_ids):
            raise ValueError(f"start: need 0 <= start < {len(token_ids)}, got {start}")
        s, kv_len = self._shape(start, n)
        if start + s > self.capacity:
            raise ValueError(f"token_ids: {len(token_ids)} tokens (padded to {start + s}) "
                             f"exceed the capacity of {self.capacity}")
        return n, s, kv_len

    def _run(self, token_ids: list[int], start: int, *, graph: bool) -> tuple[_Bucket, int]:
        n, s, kv_len = self._checked_shape(token_ids, start)
        b = self._bucket(s, kv_len, graph=graph)
        b.ids.copy_(torch.tensor([[*token_ids[start:], *[0] * (s - n)]], dtype=torch.long))
        torch.arange(start, start + s, out=b.pos)  # in place, on the device
        if graph and b.graph is not None:
            b.graph.replay()
        else:
            b.tokens.copy_(self._forward(self.kv, b.ids, b.pos, kv_len))
        return b, n

    def _bucket(self, s: int, kv_len: int, *, graph: bool) -> _Bucket:
        b = self._buckets.get((s, kv_len))
        if b is None:
            z = dict(dtype=torch.long, device=self.device)
            b = _Bucket(torch.zeros(1, s, **z), torch.arange(s, **z), torch.zeros(s, **z))
            self._buckets[(s, kv_len)] = b
        if graph and b.graph is None and self.captured < self.max_graphs:
            b.graph = self._capture(b, kv_len)
            self.captured += 1
        return b

    def _forward(self, kv: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                 kv_len: int) -> torch.Tensor:
        mask = None
        if self.kv_step is not None:  # padded keys: a query sees keys at or before its position
            keys = torch.arange(kv_len, device=self.device)
            mask = (keys[None, :] <= pos[:, None])[None, None]
        config = self.model.config
        before = config._attn_implementation
        try:
            config._attn_implementation = ATTENTION
            with torch.no_grad():
                out = self.model(input_ids=ids, position_ids=pos[None], attention_mask=mask,
                                 past_key_values=_StaticKV(kv, pos, kv_len), use_cache=True)
        finally:
            config._attn_implementation = before
        return out.logits[0].argmax(-1)

    def _capture(self, b: _Bucket, kv_len: int) -> Any:
        """Warm up on a scratch buffer (never the live ``kv``), then capture on the real one.

        The warm-up writes positions at the end of the scratch buffer; what ``pos`` holds at
        capture does not matter (every call writes it before a replay)."""
        scratch = torch.zeros_like(self.kv[:, :, :, :kv_len])
        torch.arange(kv_len - b.pos.numel(), kv_len, out=b.pos)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(scratch, b.ids, b.pos, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        del scratch
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            b.tokens.copy_(self._forward(self.kv, b.ids, b.pos, kv_len))
        return graph
