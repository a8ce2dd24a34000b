"""Multi-turn prefix reuse for transformers generation, backed by kvtier.

``ConversationStore(target, model=model)`` binds an in-process :class:`kvtier.TierEngine` (with
``tenant=``) or a daemon :class:`kvtier.client.KVTierClient` to one model:

- ``restore(token_ids) -> KVTierCache``: a ``DynamicCache`` pre-filled with the KV of the longest
  stored prefix of ``token_ids`` (whole blocks, always leaving at least one token to compute, so
  ``generate`` only prefills the rest). ``cache.restored_tokens`` says how many; a load that ends
  early (dropped or corrupt block) just restores fewer tokens: never wrong KV.
- ``restore_into(kv, token_ids, planner=None) -> int``: the same prefix copied into a
  preallocated ``[layers, 2, kv_heads, capacity, head_dim]`` buffer (a static cache, e.g.
  ``static``'s) in one copy; returns how many tokens. With a ``kvtier.planner.LoadPlanner``
  only the leading stored blocks that are cheaper to load than to recompute are loaded
  (``last_plan`` says what was chosen); with an in-process engine, blocks below the CPU tier are
  waited for only while the plan's ``patience`` lasts (``last_cut``: fewer were loaded;
  ``patient=False``: until they come).
- ``save(cache, token_ids) -> int``: after a turn, store the full blocks of ``token_ids`` whose KV
  the cache (a ``DynamicCache`` or such a buffer) holds and kvtier lacks; returns how many blocks
  it stored.

By default blocks are stored as keyed pages (CPU and disk tiers; they outlive the store and are
shared by every store of the tenant). ``keep_on_gpu=True`` keeps this store's blocks as ordinary
pages of its own pool of ``gpu_slots`` slots instead (see ``pool``): they start on the GPU
tier, the engine offloads and restores them like any page (``pool_id`` / ``page_ids()`` name
them), and they are freed by ``close``. Restore then takes the pool's pages first and continues
with keyed pages for the rest of the prefix. ``cache.restored_tiers`` counts where each block
was.

The model: ``model=`` (an ``nn.Module``; its config, dtype and device are the defaults of
``model_config``, ``dtype`` and ``device``, and its weights are fingerprinted) or an explicit
``model_id`` naming the weights, with ``model_config``, ``dtype`` and ``device``; neither is
refused. Keys are chained hashes of token ids in a namespace of the whole config, the weights'
fingerprint or ``model_id``, and the layout (see ``identity``), so two models share pages only if
they compute the same KV; kvtier salts them per tenant. Models with a layer that is not full
attention (sliding windows, ...) are refused, and ``dtype`` must be the model's.

``token_ids`` are a sequence of ints, a 1-D tensor or array, or a batch of one (``[1, n]``, as
tokenizers return); see ``tokens``. A load or store that failed (a timeout included) gives up the
staging pool it copied through (``staging``). ``close`` is idempotent and tolerates a restarted
daemon; a store dropped without it is closed by its finalizer, with a ``ResourceWarning``.

A page is one block of ``block_size`` tokens' KV across all layers, laid out
``[layer, k|v, kv_head, token, head_dim]`` in the model's dtype and padded to 4 KiB.
``layers=range(a, b)`` makes a store of one layer group: its pages hold only layers ``[a, b)``
(keys in a namespace of their own), ``restore_into`` and ``save`` take buffers of those layers
(e.g. ``kv[a:b]``) and ``restore`` is refused (see ``overlap``, which restores group by group
while the prefill runs). Batch size 1 (one conversation per cache).
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache

from kvtier.client._backend import Backend, EngineBackend, as_backend, round_page
from kvtier.client._blocks import KeyChains, namespace
from kvtier.errors import InvalidArgument
from kvtier.planner import LoadPlanner, Plan
from kvtier.types import Tier

from .identity import check_dtype, check_full_attention, model_parts, of_model
from .layered import GroupCopier, LayeredRestore, check_bounds
from .layout import KVLayout
from .pool import PoolPages
from .staging import StagingSlots
from .staging import Take as _Take
from .tokens import token_list

_Cut = Callable[[list[Tier], int], int]  # (tiers of the stored blocks, first block) -> to load


class KVTierCache(DynamicCache):
    """A ``DynamicCache`` that records what it got from kvtier."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.restored_tokens = 0
        self.restored_tiers: Counter[Tier] = Counter()


@dataclass(slots=True)
class StoreCounters:
    """What a :class:`ConversationStore` did (plain numbers, for tests and benchmarks)."""

    stored_blocks: int = 0
    restored_tokens: int = 0
    restored_from: Counter[Tier] = field(default_factory=Counter)


def _close(staging: StagingSlots, pool: PoolPages | None) -> None:
    try:
        if pool is not None:
            pool.close()
    finally:
        staging.close()


def _unclosed(staging: StagingSlots, pool: PoolPages | None) -> None:
    """A store's finalizer: it was dropped without ``close`` (as an unclosed file, warn)."""
    warnings.warn("ConversationStore dropped without close(): its pools are detached now",
                  ResourceWarning, stacklevel=1)
    with suppress(Exception):  # nothing to report to from a finalizer
        _close(staging, pool)


class ConversationStore:
    """Saves and restores a conversation's KV by token prefix. Not thread-safe (one per thread)."""

    def __init__(self, target: Any, *, model: torch.nn.Module | None = None,
                 model_config: Any = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, model_id: str = "",
                 tenant: str | None = None, block_size: int = 256, staging_slots: int = 32,
                 keep_on_gpu: bool = False, gpu_slots: int = 64, layers: range | None = None,
                 patient: bool = True) -> None:
        model_config, dtype, device = of_model(model, model_config, dtype, device)
        check_full_attention(model_config)
        check_dtype(model, dtype)
        self.layout = KVLayout.of(model_config, block_size, dtype)
        self.layers = range(self.layout.layers) if layers is None else layers
        self._group = layers is not None
        extra: tuple[object, ...] = ()
        if layers is not None:  # a layer group's own pages, in a namespace of its own
            if not (layers.step == 1 and 0 <= layers.start < layers.stop <= self.layout.layers):
                raise InvalidArgument("layers", f"need a range within [0, "
                                                f"{self.layout.layers}), got {layers}")
            self.layout = replace(self.layout, layers=len(layers))
            extra = (("layers", layers.start, layers.stop),)
        self.backend: Backend = as_backend(target, tenant)
        self.device = torch.device(device)
        self.model_config = model_config
        self.ns = namespace("hf", *model_parts(model_config, model, model_id), self.layout, *extra)
        self._chains = KeyChains(block_size, ns=self.ns)
        self.counters = StoreCounters()
        page = round_page(self.layout.raw_bytes)
        self._staging = StagingSlots(self.backend, staging_slots, page)
        self._pool: PoolPages | None = None
        self.last_plan: Plan | None = None  # the planner's choice in the last restore_into
        self.last_cut = False  # that restore lent fewer blocks than planned (see restore_layered)
        self._patient = patient  # planned loads wait for blocks below the CPU only while it pays
        self._copier: GroupCopier | None = None  # copies of borrowed pages (in-process engines)
        self._lending = isinstance(self.backend, EngineBackend)
        try:
            if keep_on_gpu:
                self._pool = PoolPages(self.backend, gpu_slots, page)
        except BaseException:
            self._staging.close()
            raise
        # Dropped without close: detach anyway (a daemon keeps a client's pools until it leaves).
        self._finalizer = weakref.finalize(self, _unclosed, self._staging, self._pool)
        self._finalizer.atexit = False

    @property
    def pool_id(self) -> int:
        """The pool holding this store's pages (``keep_on_gpu=True`` only)."""
        if self._pool is None:
            raise ValueError("pool pages need keep_on_gpu=True")
        return self._pool.pool_id

    @property
    def staging_replaced(self) -> int:
        """Staging pools given up after a failed load or store (see ``staging``)."""
        return self._staging.replaced

    def page_ids(self) -> list[int]:
        """This store's pool pages, oldest first (empty unless ``keep_on_gpu=True``)."""
        return [] if self._pool is None else self._pool.page_ids()

    def close(self) -> None:
        """Detach the staging pool (keyed blocks stay in kvtier) and free the pool pages.
        Idempotent; a daemon that no longer knows the pools (restarted) is not an error."""
        self._finalizer.detach()
        _close(self._staging, self._pool)

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- restore --------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` :meth:`restore` would restore now."""
        token_ids = token_list(token_ids)
        return self._held(self._restorable_keys(token_ids)) * self.layout.block_size

    def stored_tiers(self, token_ids: Sequence[int]) -> list[Tier]:
        """The tier of each keyed block of the longest stored prefix (pool pages not counted)."""
        return self._lookup(self._restorable_keys(token_list(token_ids)))

    def _held(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` kvtier holds: pool pages first, then keyed pages."""
        n = 0 if self._pool is None else self._pool.known(keys)
        return n + len(self._lookup(keys[n:]))

    def restore(self, token_ids: Sequence[int]) -> KVTierCache:
        """A cache holding the KV of the longest stored prefix (possibly empty)."""
        if self._group:
            raise ValueError("restore: a store of a layer group restores into buffers only")
        token_ids = token_list(token_ids)
        cache = KVTierCache(config=self.model_config)
        parts: list[torch.Tensor] = []
        tiers = self._restore_rows(self._restorable_keys(token_ids),
                                   lambda rows, first: parts.append(rows.clone()))
        cache.restored_tiers.update(t for t in tiers if t is not None)
        if parts:
            rows = torch.cat(parts) if len(parts) > 1 else parts[0]
            kv = self.layout.unpack(rows.to(self.device))
            for layer in range(self.layout.layers):
                cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
            cache.restored_tokens = kv.shape[3]
        self._count(cache.restored_tokens, cache.restored_tiers)
        return cache

    def restore_into(self, kv: torch.Tensor, token_ids: Sequence[int], *,
                     planner: LoadPlanner | None = None) -> int:
        """Copy the KV of the longest stored prefix of ``token_ids`` into ``kv`` and return how
        many tokens that is (whole blocks, at least one token left to compute).

        ``kv`` is a preallocated ``[layers, 2, kv_heads, capacity, head_dim]`` tensor of the
        model's dtype on the store's device, e.g. the buffers behind a static cache that a
        captured CUDA graph reads: the prefix lands at positions ``[0, n)`` straight from the
        staging slots (one copy per load), and positions from ``n`` on are left as they were.
        At most ``capacity`` tokens are restored. With ``planner``, the stored blocks past the
        pool pages are loaded only as far as the plan says (the rest is left to the prefill).
        """
        self._check_kv(kv)
        token_ids = token_list(token_ids)
        if self._lends():
            restore = self.restore_layered(kv, token_ids, [0, self.layout.layers],
                                           planner=planner)
            restore.wait_all()
            restore.release()
            return restore.tokens
        bs = self.layout.block_size
        keys = self._restorable_keys(token_ids)[: kv.shape[3] // bs]
        self.last_plan, self.last_cut = None, False
        cut: _Cut | None = None
        if planner is not None:
            cut = lambda tiers, first: self._plan(planner, tiers, first, len(token_ids))  # noqa: E731
        tiers = self._restore_rows(
            keys, lambda rows, first: self.layout.unpack_into(kv, rows, first * bs), cut)
        self._count(len(tiers) * bs, Counter(t for t in tiers if t is not None))
        return len(tiers) * bs

    def restore_layered(self, kv: torch.Tensor, token_ids: Sequence[int], bounds: Sequence[int],
                        *, planner: LoadPlanner | None = None) -> LayeredRestore:
        """:meth:`restore_into`, layer group by layer group, without waiting for the copies.

        ``bounds`` cut the layers into groups (``0 = b0 < b1 < ... = layers``). With an
        in-process engine the stored prefix is borrowed in place and copied group by group on a
        copy stream (``layered``): ``wait(g)`` makes the current stream wait for group ``g``
        only, so the layers of group ``g`` can run while later groups are still copied. Call
        ``release()`` once the prefill has consumed the buffer (the pages stay protected until
        then). Through a daemon (or with pool pages) the prefix is loaded whole, as
        :meth:`restore_into` does, and the returned restore has nothing left to wait for.
        """
        check_bounds(bounds, self.layout.layers)
        if not self._lends():
            return LayeredRestore.done(self.restore_into(kv, token_ids, planner=planner))
        self._check_kv(kv)
        token_ids = token_list(token_ids)
        keys = self._restorable_keys(token_ids)[: kv.shape[3] // self.layout.block_size]
        self.last_plan, self.last_cut = None, False
        cut = None  # planned on the tiers the engine lends from (no demotion in between)
        if planner is not None:
            cut = lambda tiers: self._plan(planner, tiers, 0, len(token_ids))  # noqa: E731
        handle = self._staging.handle
        held = self.backend.borrow(handle, keys, cut, self._patience) if keys else None
        if held is None:
            return LayeredRestore.done(0)
        self.last_cut = held.cut
        if self._copier is None:
            self._copier = GroupCopier(self.layout, self.device)
        restore = self._copier.start(kv, held.views, bounds, held.release)
        self._count(restore.tokens, Counter(held.tiers))
        return restore

    def _lends(self) -> bool:
        """Whether restores borrow the engine's pages (an in-process engine, keyed pages only)."""
        return self._pool is None and not self._group and self._lending

    def _check_kv(self, kv: torch.Tensor, name: str = "kv") -> None:
        self.layout.check(kv, self.device, name)

    def _patience(self, landed: int) -> float:
        """How long a planned load may wait for its blocks below the CPU tier (the plan's
        ``patience``: stopped short, the rest is recomputed at no more than a late block's cost);
        without a plan, until they come."""
        plan = self.last_plan
        return math.inf if plan is None or not self._patient else plan.patience(landed)

    def _plan(self, planner: LoadPlanner, tiers: list[Tier], first: int, total: int) -> int:
        self.last_plan = planner(tiers, total, first)
        return self.last_plan.load

    def _restore_rows(self, keys: list[bytes], take: _Take,
                      cut: _Cut | None = None) -> list[Tier | None]:
        """Hand ``take`` the bytes of the longest loadable prefix of ``keys`` (pool pages first,
        then keyed pages), a chunk at a time; returns the tier each block came from."""
        tiers: list[Tier | None] = []
        if self._pool is not None:
            rows, got = self._pool.load(keys, self.layout.raw_bytes)
            if rows is not None:
                take(rows, 0)
                tiers += got
        return tiers + self._load_keyed(keys[len(tiers) :], take, len(tiers), cut)

    def _count(self, tokens: int, tiers: Counter[Tier]) -> None:
        self.counters.restored_tokens += tokens
        self.counters.restored_from.update(tiers)

    def _restorable_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        n = max(0, (len(token_ids) - 1) // self.layout.block_size) * self.layout.block_size
        return self._chains.keys(token_ids[:n])

    def _lookup(self, keys: list[bytes]) -> list[Tier]:
        return self.backend.lookup(keys) if keys else []

    def _load_keyed(self, keys: list[bytes], take: _Take, first: int,
                    cut: _Cut | None = None) -> list[Tier | None]:
        """Load the longest loadable keyed prefix of ``keys`` (the first ``cut(tiers, first)``
        blocks of it, with a ``cut``) into ``take``; the tiers."""
        tiers = self._lookup(keys)
        if cut is not None:
            tiers = tiers[: cut(tiers, first)]
            keys = keys[: len(tiers)]
        got: list[Tier | None] = []
        step, raw = self._staging.num_slots, self.layout.raw_bytes
        for i in range(0, len(tiers), step):
            n = self._staging.load(keys[i : i + step], take, first + i, raw)
            got += tiers[i : i + n]
            if n < len(keys[i : i + step]):
                break
        return got

    # --- save -----------------------------------------------------------------------------------
    def save(self, cache: DynamicCache | torch.Tensor, token_ids: Sequence[int], *,
             wait_s: float = 0.0) -> int:
        """Store the full blocks of ``token_ids`` that ``cache`` holds and kvtier lacks.

        ``cache`` is a ``DynamicCache`` or a ``[layers, 2, kv_heads, capacity, head_dim]`` tensor
        (as :meth:`restore_into` fills) holding the KV of ``token_ids`` at positions
        ``[0, len(token_ids))``. A full CPU tier stores what fits while it demotes older pages in
        the background; ``wait_s > 0`` keeps retrying the rest until that long has passed.
        """
        token_ids = token_list(token_ids)
        deadline = time.monotonic() + wait_s
        total = self._save_once(cache, token_ids)
        while wait_s > 0 and time.monotonic() < deadline and self._missing(cache, token_ids):
            time.sleep(0.005)
            total += self._save_once(cache, token_ids)
        return total

    def _held_tokens(self, cache: DynamicCache | torch.Tensor, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` have their KV in ``cache``."""
        if isinstance(cache, torch.Tensor):
            self._check_kv(cache, "cache")
            return min(len(token_ids), cache.shape[3])
        if not hasattr(cache, "get_seq_length"):
            raise InvalidArgument("cache", f"need a DynamicCache or a KV tensor, got "
                                           f"{type(cache).__name__}")
        return min(len(token_ids), cache.get_seq_length())

    def _missing(self, cache: DynamicCache | torch.Tensor, token_ids: Sequence[int]) -> bool:
        n = self._held_tokens(cache, token_ids) // self.layout.block_size
        n *= self.layout.block_size
        return self.lookup([*token_ids[:n], 0]) < n

    def _save_once(self, cache: DynamicCache | torch.Tensor, token_ids: Sequence[int]) -> int:
        held = self._held_tokens(cache, token_ids)
        bs = self.layout.block_size
        keys = self._chains.keys(token_ids[: held // bs * bs])
        pool = self._pool
        start = len(self._lookup(keys)) if pool is None else pool.known(keys)
        if start == len(keys):
            return 0
        kv = self._gather(cache, start * bs, len(keys) * bs)
        rows = self.layout.pack(kv)
        if pool is not None:
            saved = pool.save(keys[start:], rows)
            self.counters.stored_blocks += saved
            return saved
        stored, step = 0, self._staging.num_slots
        for i in range(0, rows.shape[0], step):
            n = self._staging.store(keys[start + i : start + i + step], rows[i : i + step])
            stored += n
            if n < min(step, rows.shape[0] - i):
                break
        self.counters.stored_blocks += stored
        return stored

    def _gather(self, cache: DynamicCache | torch.Tensor, begin: int, end: int) -> torch.Tensor:
        if isinstance(cache, torch.Tensor):
            return cache[:, :, :, begin:end]
        layers: list[Any] = list(cache.layers)
        if len(layers) < self.layers.stop or (not self._group and len(layers) != len(self.layers)):
            raise ValueError(f"cache has {len(layers)} layers, the model {self.layout.layers}")
        layers = layers[self.layers.start : self.layers.stop]
        if layers[0].keys.shape[0] != 1:
            raise ValueError("ConversationStore handles batch size 1 only")
        got = {lay.keys.dtype for lay in layers} | {lay.values.dtype for lay in layers}
        if got != {self.layout.dtype}:
            raise InvalidArgument("cache", f"KV of {sorted(map(str, got))}, the store's is "
                                           f"{self.layout.dtype}: make the store of the model's")
        return torch.stack([
            torch.stack([lay.keys[0, :, begin:end], lay.values[0, :, begin:end]])
            for lay in layers
        ])
