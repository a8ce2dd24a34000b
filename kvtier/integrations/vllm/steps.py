"""Worker side of the vLLM connector, one step at a time: attach, load, and store only real KV.

``WorkerSteps(link, rows, rank=..., register=..., staging_slots=..., exchange=...)``:

- ``begin(loads) -> set[int]``: load this step's planned blocks (under this rank's keys) before
  the forward; returns the vLLM block ids that do not hold their stored bytes (vLLM recomputes
  them). Those ids, joined over every rank through ``exchange`` (the forward of one rank reads
  every rank's KV through the all-reduce), taint this step.
- ``end(stores)``: after the forward, store each planned run only up to its first block whose
  chain (the request's earlier blocks, then the run) meets a tainted block: a block computed
  while attending to a block that failed to load is garbage and must never be stored.
- The daemon may be away at start, or restart at any time: every daemon error drops the pool,
  the link backs off and warns once, and the next step re-attaches (a fresh pool) when the
  daemon answers. Until then loads are misses and stores are skipped; the engine never fails.

Contract: ``exchange`` is called on every rank in every step with loads (the metadata is the
same on every rank), never otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

from kvtier.client._backend import ClientBackend
from kvtier.client.block_mover import BlockMover, MoverCounters
from kvtier.client.block_rows import BlockRows

from .identity import Rank, rank_keys
from .link import DaemonLink
from .plan import BlockTransfer


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
                 exchange: Callable[[set[int]], set[int]] | None = None) -> None:
        self.link, self.rows, self.rank, self._log = link, rows, rank, log
        self._register, self._slots = register, staging_slots
        self._exchange = exchange
        self.counters = MoverCounters()
        self._mover: BlockMover | None = None
        self._tainted: set[int] = set()

    @property
    def register(self) -> bool:
        return self._register

    def mover(self) -> BlockMover | None:
        """The attached mover, attaching first if the daemon may be back; ``None`` if away."""
        if self._mover is None and self.link.ready():
            try:
                self._mover = BlockMover(ClientBackend(self.link.client()), self.rows,
                                         register=self._register, staging_slots=self._slots,
                                         counters=self.counters)
            except Exception as exc:
                self.link.failed(exc)
                return None
            self.link.ok()
            self._log.info("kvtier: rank %d/%d %s %d blocks of %d bytes", self.rank.tp_rank,
                           self.rank.world, "registered" if self._register else
                           "attached staging for", self.rows.num_blocks, self.rows.page_bytes)
        return self._mover

    def _broken(self, exc: BaseException) -> None:
        old, self._mover = self._mover, None
        if old is not None:
            with contextlib.suppress(Exception):  # a restarted daemon no longer knows it
                old.close()
        self.link.failed(exc)

    def _keyed(self, t: BlockTransfer, n: int) -> BlockTransfer:
        return BlockTransfer(t.req_id, rank_keys(t.keys[:n], self.rank), t.block_ids[:n])

    def begin(self, loads: Sequence[BlockTransfer]) -> set[int]:
        invalid: set[int] = set()
        mover = self.mover() if loads else None
        for t in loads:
            got, counted = 0, False
            if mover is not None:
                try:
                    got, counted = mover.load(self._keyed(t, len(t.keys))), True
                except Exception as exc:
                    self._broken(exc)
                    mover = None
            if not counted:  # the daemon was away: the mover never saw these blocks
                self.counters.load_failed_blocks += len(t.block_ids)
            if got < len(t.block_ids):
                invalid.update(t.block_ids[got:])
                self._log.warning("kvtier: %d of %d blocks of %s did not load; recomputing",
                                  len(t.block_ids) - got, len(t.block_ids), t.req_id)
        tainted = set(invalid)
        if loads and self._exchange is not None:
            tainted = self._exchange(tainted)
        self._tainted = tainted
        return invalid

    def end(self, stores: Sequence[BlockTransfer]) -> None:
        tainted, self._tainted = self._tainted, set()
        mover = self.mover() if stores else None
        for t in stores:
            n = safe_length(t, tainted)
            self.counters.unsafe_store_blocks += len(t.block_ids) - n
            if n == 0 or mover is None:
                continue
            try:
                mover.store(self._keyed(t, n))
            except Exception as exc:
                self._broken(exc)
                mover = None

    def close(self) -> None:
        if self._mover is not None:
            try:
                self._mover.close()
            except Exception as exc:
                self._log.warning("kvtier: detach failed: %s", exc)
            self._mover = None
