"""Scheduler side of the vLLM connector: which blocks to load from and store to kvtier.

``LoadStorePlanner`` keeps, per running request, its vLLM block ids and how many of its leading
blocks kvtier already holds. Contract with vLLM's scheduler (``KVConnectorBase_V1``):

- ``matched_tokens(request, num_computed)``: tokens beyond ``num_computed`` that kvtier holds —
  the longest stored prefix of the request's chained block keys, never the last token (vLLM must
  compute at least one). Side-effect free apart from remembering the hit for the next call.
  ``None`` (vLLM asks again next step) while the first missing block is one this engine planned
  to store less than ``store_wait_s`` ago: its store is still in flight on the worker.
- ``after_alloc(request, block_ids, num_external)``: plan the load of those tokens' blocks.
- ``build(new_reqs, cached_reqs, num_scheduled)``: this step's ``(loads, stores)``; a store covers
  every block that becomes full in this step (prompt or output) and kvtier does not hold yet, and
  names the request's earlier blocks (``prefix_ids``) so the worker can refuse a run whose chain
  met a block that failed to load. When vLLM rewinds a request (a failed load, a preemption) the
  blocks it recomputes are planned for storing again.
- ``finished(req_id) -> bool``: forget the request; ``True`` when stores were planned for it
  (with ``async_stores``): vLLM then keeps its blocks until the workers report it through
  ``get_finished``, which they learn from ``take_delayed()`` in the next step's metadata.

Keys are vLLM's own block hashes re-keyed into our namespace when they are reproducible across
processes; otherwise chained hashes of the token ids. Either way the namespace is the engine's
(``identity.engine_namespace``) plus the request's salt (LoRA adapter, ``cache_salt``,
multimodal inputs: ``identity.request_salt``), so nothing that changes KV for the same
tokens is left out on any path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client._blocks import chain_keys, namespace, rekey
from kvtier.client.block_mover import BlockTransfer

from .identity import request_salt


@dataclass(slots=True)
class _Req:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    held: int = 0  # leading blocks kvtier holds (loaded, found or stored)
    keys: list[bytes] = field(default_factory=list)
    ns: bytes | None = None


class LoadStorePlanner:
    """Not thread-safe: vLLM calls the scheduler connector from one thread."""

    def __init__(self, lookup: Callable[[list[bytes]], int | None], block_size: int, ns: bytes,
                 *, use_engine_hashes: bool, async_stores: bool = False,
                 store_wait_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup  # None: the daemon is away (a miss not worth waiting for)
        self.block_size = block_size
        self.ns = ns
        self.use_engine_hashes = use_engine_hashes
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, int] = {}
        self._loads: list[BlockTransfer] = []
        self._async, self._wait_s, self._clock = async_stores, store_wait_s, clock
        self._pending: dict[bytes, float] = {}  # key planned for storing -> wait for it until
        self._stored: set[str] = set()  # requests with stores planned
        self._delayed: list[str] = []

    # --- keys -------------------------------------------------------------------------------
    def keys(self, request: Any, n: int) -> list[bytes]:
        """The first ``n`` block keys of ``request`` (``n`` ≤ its full blocks)."""
        st = self._reqs.get(request.request_id)
        cached = st.keys if st is not None else []
        if len(cached) >= n:
            return cached[:n]
        ns = st.ns if st is not None and st.ns is not None else self.request_ns(request)
        if st is not None:
            st.ns = ns
        hashes = getattr(request, "block_hashes", None) or []
        if self._engine_keyed(request) and len(hashes) >= n:
            keys = cached + rekey(hashes[len(cached) : n], ns=ns)
        else:
            keys = chain_keys(list(request.all_token_ids[: n * self.block_size]),
                              self.block_size, ns=ns)
        if st is not None:
            st.keys = keys
        return keys

    def _engine_keyed(self, request: Any) -> bool:
        """Whether ``request``'s keys come from vLLM's block hashes: one per block of ours (else
        they were hashed at another granularity), and usable (``use_engine_hashes``)."""
        hashes = getattr(request, "block_hashes", None) or []
        return self.use_engine_hashes and len(hashes) == request.num_tokens // self.block_size

    def cacheable(self, request: Any) -> bool:
        """A request given as prompt embeddings has token ids that say nothing of its KV (vLLM
        sets them to 0): keyed by token ids, two such prompts shared keys and one was served the
        other's KV. Only vLLM's own hashes (which cover the embeddings) may key it."""
        return getattr(request, "prompt_embeds", None) is None or self._engine_keyed(request)

    def request_ns(self, request: Any) -> bytes:
        """The engine namespace, salted with what changes this request's KV for its tokens."""
        salt = request_salt(request)
        return namespace(self.ns, salt) if salt else self.ns

    # --- vLLM scheduler hooks ---------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed: int) -> int | None:
        if not self.cacheable(request):
            return 0
        n = max(0, (request.num_tokens - 1) // self.block_size)
        keys = self.keys(request, n)
        found = self._lookup(keys) if n else 0
        hits = found or 0
        for k in keys[:hits]:
            self._pending.pop(k, None)
        if found is not None and hits < n and self._pending.get(keys[hits], 0.0) > self._clock():
            return None  # our own store of the next block is in flight: ask again next step
        self._hits[request.request_id] = hits
        return max(0, hits * self.block_size - num_computed)

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        if not self.cacheable(request):
            return  # never tracked: nothing loaded or stored for it
        st = self._reqs.setdefault(request.request_id, _Req(request))
        st.request = request
        st.block_ids = list(block_ids)
        hits = self._hits.pop(request.request_id, 0)
        st.held = max(st.held, hits)
        if num_external <= 0:
            return
        first = hits - num_external // self.block_size
        keys = self.keys(request, hits)[first:]
        self._loads.append(BlockTransfer(request.request_id, keys, st.block_ids[first:hits]))

    def build(self, new_reqs: Sequence[Any], cached: Any,
              num_scheduled: dict[str, int], spec: dict[str, list[int]]
              ) -> tuple[list[BlockTransfer], list[BlockTransfer]]:
        """This step's loads and stores; resets the pending loads."""
        computed: dict[str, int] = {}
        for nr in new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is not None:
                st.block_ids = list(nr.block_ids[0])
                computed[nr.req_id] = nr.num_computed_tokens
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new[0]) if new is not None else []
            elif new is not None:
                st.block_ids.extend(new[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done in computed.items():  # vLLM rewound it: its later blocks are recomputed
            st = self._reqs[req_id]
            st.held = min(st.held, done // self.block_size)
        stores = []
        for req_id, done in computed.items():
            after = done + num_scheduled.get(req_id, 0) - len(spec.get(req_id, ()))
            t = self._store_plan(self._reqs[req_id], after)
            if t is not None:
                stores.append(t)
        loads, self._loads = self._loads, []
        if self._async:
            self._in_flight(stores)
        return loads, stores

    def _in_flight(self, stores: list[BlockTransfer]) -> None:
        now = self._clock()
        self._pending = {k: t for k, t in self._pending.items() if t > now}
        for t in stores:
            self._stored.add(t.req_id)
            for k in t.keys:
                self._pending[k] = now + self._wait_s

    def _store_plan(self, st: _Req, computed_after: int) -> BlockTransfer | None:
        full = min(computed_after // self.block_size, len(st.block_ids),
                   st.request.num_tokens // self.block_size)
        if full <= st.held:
            return None
        keys = self.keys(st.request, full)[st.held :]
        t = BlockTransfer(st.request.request_id, keys, st.block_ids[st.held : full],
                          st.block_ids[: st.held])
        st.held = full
        return t

    def finished(self, req_id: str) -> bool:
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)
        if req_id not in self._stored:
            return False
        self._stored.discard(req_id)
        self._delayed.append(req_id)
        return True

    def take_delayed(self) -> list[str]:
        """Requests delayed since the last call (the workers report each when its stores end)."""
        out, self._delayed = self._delayed, []
        return out
