"""Worker side of the vLLM connector, one step at a time: attach, load, and store only real KV.

``WorkerSteps(link, rows, rank=..., register=..., staging_slots=..., exchange=..., layers=...,
async_stores=True, layer_loads=True)``:

- ``start(loads)``: issue this step's planned loads (under this rank's keys). With
  ``layer_loads`` they run on a loader thread and ``wait_layer(name)`` waits for one layer only
  (``loads.LoadJob``); without, they finish before ``start`` returns.
- ``join_loads()``: wait for the loads; the vLLM block ids that do not hold their stored bytes
  (vLLM recomputes them) go to ``take_invalid()``. Those ids, joined over every rank through
  ``exchange`` (the forward of one rank reads every rank's KV through the all-reduce), taint
  this step. ``begin(loads) -> set[int]`` is ``start`` + ``join_loads`` + ``take_invalid``.
- ``end(stores)``: after the forward, store each planned run only up to its first block whose
  chain (the request's earlier blocks, then the run) meets a tainted block: a block computed
  while attending to a block that failed to load is garbage and must never be stored. With
  ``async_stores`` a store runs on the store thread once an event recorded now on the current
  stream has completed (``stores.StoreQueue``; ``on_stored()`` is called there after each);
  without, after a device synchronize, here.
- ``finished(delayed) -> set[str]``: requests whose blocks vLLM kept for our stores and whose
  stores have all ended. ``flush_stores()``: wait for every store (preemption: blocks are about
  to be reused). ``close()``: bounded flush, then detach.
- The daemon may be away at start, or restart at any time: every daemon error drops the pool,
  the link backs off and warns once, and the next step re-attaches (a fresh pool) when the
  daemon answers. Until then loads are misses and stores are skipped; the engine never fails.

Contract: ``exchange`` is called on every rank in every step with loads (the metadata is the
same on every rank), never otherwise. All methods are called from vLLM's worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvtier.client._backend import ClientBackend
from kvtier.client.block_mover import BlockMover, MoverCounters
from kvtier.client.block_rows import BlockRows

from .identity import Rank, rank_keys
from .link import DaemonLink
from .loads import LoadJob
from .plan import BlockTransfer
from .stores import StoreQueue

_DETACH_WAIT_S = 0.5  # how long a broken attach's detach may hold the engine's step


def _close_all(movers: list[BlockMover]) -> None:
    for m in movers:
        with contextlib.suppress(Exception):  # a restarted daemon no longer knows it
            m.close()


class StoreFailed(Exception):
    """A store of the pool attached as ``generation`` failed (its cause is the daemon's error)."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"store of attach #{generation} failed")
        self.generation = generation


def safe_length(t: BlockTransfer, tainted: set[int]) -> int:
    """How many leading blocks of ``t`` have no tainted block before or at them in the chain."""
    if not tainted:
        return len(t.block_ids)
    if any(b in tainted for b in t.prefix_ids):
        return 0
    for i, b in enumerate(t.block_ids):
        if b in tainted:
            return i
    return len(t.block_ids)


class WorkerSteps:
    def __init__(self, link: DaemonLink, rows: BlockRows, log: logging.Logger, *, rank: Rank,
                 register: bool, staging_slots: int,
                 exchange: Callable[[set[int]], set[int]] | None = None,
                 layers: Mapping[str, range] | None = None, async_stores: bool = True,
                 layer_loads: bool = True, load_groups: int = 1, store_timeout_s: float = 30.0,
                 before_layer: Callable[[int], None] | None = None,
                 on_stored: Callable[[], None] | None = None) -> None:
        self.link, self.rows, self.rank, self._log = link, rows, rank, log
        self._register, self._slots = register, staging_slots
        self._exchange = exchange
        self.counters = MoverCounters()
        self._mover: BlockMover | None = None
        self._store_mover: BlockMover | None = None
        self._generation = 0
        self._failed_generation = -1  # a store of this attach failed: its later ones are skipped
        self._tainted: set[int] = set()
        layers = layers or {"": range(len(rows.segments))}
        self._layer_index = {name: i for i, name in enumerate(layers)}
        self._layers = list(layers.values())
        self._async, self._layer_loads = async_stores, layer_loads
        self._load_groups = load_groups  # registered loads: layer groups per load (``groups``)
        self._before_layer, self._on_stored = before_layer, on_stored
        self._stores = StoreQueue(store_timeout_s)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._job: LoadJob | None = None
        self._loads: list[BlockTransfer] = []
        self._invalid: set[int] = set()

    @property
    def register(self) -> bool:
        return self._register

    def mover(self) -> BlockMover | None:
        """The attached mover, attaching first if the daemon may be back; ``None`` if away."""
        if self._mover is None and self.link.ready():
            mover: BlockMover | None = None
            try:
                backend = ClientBackend(self.link.client())
                mover = BlockMover(backend, self.rows, register=self._register,
                                   staging_slots=self._slots, counters=self.counters)
                # Copy mode: stores get a staging pool of their own, so a load never waits
                # for slots a store in flight holds.
                store = mover if self._register else BlockMover(
                    backend, self.rows, register=False, staging_slots=self._slots,
                    counters=self.counters)
            except Exception as exc:
                if mover is not None:
                    with contextlib.suppress(Exception):
                        mover.close()
                self.link.failed(exc)
                return None
            self._mover, self._store_mover = mover, store
            self._generation += 1
            self.counters.attaches += 1
            self.link.ok()
            self._log.info("kvtier: rank %d/%d %s %d blocks of %d bytes", self.rank.tp_rank,
                           self.rank.world, "registered" if self._register else
                           "attached staging for", self.rows.num_blocks, self.rows.page_bytes)
        return self._mover

    def _broken(self, exc: BaseException) -> None:
        old = list({id(m): m for m in (self._mover, self._store_mover) if m is not None}.values())
        self._mover = self._store_mover = None
        if old:  # a live daemon answers at once; a hung one is not waited out (a timeout each)
            detach = threading.Thread(target=_close_all, args=(old,), name="kvtier-detach",
                                      daemon=True)
            detach.start()
            detach.join(_DETACH_WAIT_S)
        self.link.failed(exc)

    def _keyed(self, t: BlockTransfer, n: int) -> BlockTransfer:
        return BlockTransfer(t.req_id, rank_keys(t.keys[:n], self.rank), t.block_ids[:n])

    # --- loads ------------------------------------------------------------------------------
    def start(self, loads: Sequence[BlockTransfer]) -> None:
        self.join_loads()  # a step's loads end within it; this only guards misuse
        self._loads = list(loads)
        mover = self.mover() if loads else None
        if mover is None:
            return
        job = LoadJob(mover, [self._keyed(t, len(t.keys)) for t in loads], self._layers,
                      before_layer=self._before_layer, groups=self._load_groups)
        self._job = job
        if self._layer_loads:
            self._loader.submit(job.run)
        else:
            job.run()

    def wait_layer(self, name: str) -> None:
        i = self._layer_index.get(name)
        if self._job is not None and i is not None:
            self._job.wait_layer(i)

    def join_loads(self) -> None:
        loads, job = self._loads, self._job
        if not loads:
            return
        self._loads, self._job = [], None
        got = job.result() if job is not None else [0] * len(loads)
        if job is None:  # the daemon was away: the mover never saw these blocks
            self.counters.load_failed_blocks += sum(len(t.block_ids) for t in loads)
        elif job.error is not None and self._mover is job.mover:
            self._broken(job.error)
        invalid: set[int] = set()
        for t, n in zip(loads, got, strict=True):
            if n < len(t.block_ids):
                invalid.update(t.block_ids[n:])
                self._log.warning("kvtier: %d of %d blocks of %s did not load; recomputing",
                                  len(t.block_ids) - n, len(t.block_ids), t.req_id)
        self._invalid |= invalid
        self._tainted = self._exchange(invalid) if self._exchange is not None else invalid

    def take_invalid(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def begin(self, loads: Sequence[BlockTransfer]) -> set[int]:
        """Load before returning; the block ids that did not load (see the module docstring)."""
        self.start(loads)
        self.join_loads()
        return self.take_invalid()

    # --- stores -----------------------------------------------------------------------------
    def end(self, stores: Sequence[BlockTransfer]) -> None:
        self.join_loads()
        self._reap()
        tainted, self._tainted = self._tainted, set()
        mover = self.mover() if stores else None
        ready = self._ready_event() if stores and self._async else None
        for t in stores:
            n = safe_length(t, tainted)
            self.counters.unsafe_store_blocks += len(t.block_ids) - n
            if n == 0 or mover is None or self._store_mover is None:
                continue
            keyed = self._keyed(t, n)
            if self._async:
                self._stores.submit(t.req_id, self._store_job(self._store_mover, keyed), ready)
                continue
            try:
                if self.rows.segments[0].is_cuda:
                    torch.cuda.synchronize(self.rows.segments[0].device)
                self._store_mover.store(keyed)
            except Exception as exc:
                self._broken(exc)
                mover = None

    def _ready_event(self) -> Any:
        """An event after the forward's writes (CUDA); ``None`` where they are already done."""
        if not self.rows.segments[0].is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.rows.segments[0].device))
        return ev

    def _store_job(self, mover: BlockMover, t: BlockTransfer) -> Callable[[], None]:
        generation = self._generation

        def job() -> None:
            if self._failed_generation == generation:
                # An earlier store of this attach failed (the daemon is gone, or hung: each
                # store queued behind it waited out its own timeout, a preemption's flush
                # 45 s in all): the pool is dropped at the next step, these are skipped.
                self.counters.store_calls += 1
                self.counters.store_failed_blocks += len(t.keys)
                return
            try:
                with torch.inference_mode():  # staging pools made in the engine's step are
                    mover.store(t)  # inference tensors, written in place only in this mode
            except Exception as exc:
                self._failed_generation = generation
                self.counters.store_failed_blocks += len(t.keys)
                raise StoreFailed(generation) from exc
            if self._on_stored is not None:
                try:
                    self._on_stored()
                except Exception as exc:  # counters only: never a reason to drop the pool
                    self._log.debug("kvtier: on_stored failed: %s", exc)
        return job

    def _reap(self) -> None:
        for exc in self._stores.reap():
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            if isinstance(exc, StoreFailed) and exc.generation == self._generation:
                self._broken(cause)
            else:
                self._log.debug("kvtier: a store of an earlier attach failed: %s", cause)

    def finished(self, delayed: Sequence[str] | set[str]) -> set[str]:
        self._reap()
        return self._stores.finished(delayed)

    def flush_stores(self) -> None:
        self._stores.flush()
        self._reap()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.join_loads()
        if not self._stores.close():
            self._log.warning("kvtier: stores still in flight at shutdown were dropped")
        self._loader.shutdown(wait=True)
        for m in {id(m): m for m in (self._mover, self._store_mover) if m is not None}.values():
            try:
                m.close()
            except Exception as exc:
                self._log.warning("kvtier: detach failed: %s", exc)
        self._mover = self._store_mover = None
