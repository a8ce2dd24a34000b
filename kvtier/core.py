"""Engine core: the placement of pages plus the lock, the lanes and the move machinery.

Contract (every method here runs with ``self.cond`` held, except ``complete`` which takes it):
    * ``EngineCore`` is a ``Placement`` (``state/placement.py``: the page table, tiers,
      policies, ledger; ``settle``/``unsettle``/``release``/``drop``/pins) that composes the
      pieces which move pages (``kvtier.moves``), each built on the narrow things it uses,
      never on the core: ``bulk`` (``moves/batch.py``: per-batch prepare/finish), ``completion``
      (``moves/completion.py``: what the lanes report), ``starts`` (``moves/starter.py``:
      ``offload`` / ``restore_cpu`` / ``restore_below`` / ``cancel``) and the ``cascade`` it
      builds (``moves/demotion.py``: room below the GPU, walking the tier chain down).
    * Pages are page-table rows (int64 arrays of distinct rows); every step is one numpy pass
      or one policy call per batch, never Python work per page on the transfer paths.
    * A page that gets no destination slot stays where it was; ``complete(batch, results)``
      finishes moves: success frees the source slot and makes the destination the page's home;
      failure frees the destination and puts the page back (a failed disk read drops the page:
      its stored bytes are not trustworthy).
    * Room is made by cascades: CPU full -> CPU victims go one tier down the chain (disk by
      default) through the admission rule, or are dropped; the last tier full -> its victims
      are dropped. Drops are counted and published.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.config import MIB, OffloadConfig
from kvtier.moves.batch import BulkMoves
from kvtier.moves.completion import Completion
from kvtier.moves.landings import Landings
from kvtier.moves.starter import INLINE_RESTORE_BYTES, Starter
from kvtier.scheduler import TransferScheduler
from kvtier.state.placement import Placement
from kvtier.state.ready import ReadyEvents
from kvtier.tiers.pinned import HostArena
from kvtier.tiers.registry import open_chain
from kvtier.transfer import build_handlers, build_inline_restore
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import PoolId

if TYPE_CHECKING:
    from kvtier.prefix.remote import RemoteTier


class EngineCore(Placement):
    """State and mechanism shared by the public engine, prefix store and watermark thread."""

    def __init__(self, config: OffloadConfig) -> None:
        # Every GPU the daemon serves, the default (first) one as ``device``: per GPU its pools,
        # copy handlers, lanes and inline restore; the CPU and disk tiers are shared.
        self.devices = tuple(torch.device(d) for d in config.resolved_devices())
        self.device = self.devices[0]
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self.landings = Landings(lock)  # CPU->GPU moves ended; acquires wait for theirs
        cuda = self.device.type == "cuda"
        chunk = max(4096, min(config.pinned_chunk_mb * MIB, config.cpu_budget_bytes) // 4096 * 4096)
        below = open_chain(config)  # the chain's media below the CPU, top down
        host = HostArena(config.cpu_budget_bytes, chunk, pin=cuda)
        super().__init__(config, host, below)
        self.remote: RemoteTier | None = None  # set by the engine (``prefix.remote.open_remote``)
        self.ready = ReadyEvents(self.device)
        self.inline_restores = {
            str(d): build_inline_restore(d, self.host, INLINE_RESTORE_BYTES) for d in self.devices
        }
        self.bulk = BulkMoves(self, self.ready)
        self.completion = Completion(self, self.bulk, self.landings, self.cond)
        self.scheduler = self._lanes(config)
        self.starts = Starter(self, self.bulk, self.scheduler, self.completion, self.landings,
                             self.inline_restore)
        self.cascade = self.starts.cascade
        self._reload_records()

    def _lanes(self, config: OffloadConfig) -> TransferScheduler:
        below = [(self.names[level], medium) for level, medium in self.media.items()]
        handlers = build_handlers(self.device, self.host, below, config.batch_bytes,
                                  self.record_level)
        gpus = {str(d): build_handlers(d, self.host, (), config.batch_bytes)
                for d in self.devices[1:]}
        complete = self.completion.complete
        return TransferScheduler(
            handlers,
            batch_bytes=config.batch_bytes,
            max_inflight_bytes=config.max_inflight_mb * MIB,
            on_complete=complete,
            try_complete=functools.partial(complete, wait=False),
            device=str(self.device),
            gpus=gpus,
        )

    def _reload_records(self) -> None:
        """Keyed pages persisted by an earlier process come back where their medium sits in
        the chain (the disk store, wherever the chain puts it); a key found twice keeps the
        copy nearest the CPU."""
        t = self.table
        for level, medium in self.media.items():
            for page_size, slot, record in medium.records():
                if t.keyed(record.key) is not None:
                    continue
                rows = t.add(1, pool=0, size=page_size, owner=self.ledger.owner(record.tenant))
                t.add_key(int(rows[0]), record.key, record.tenant)
                self.settle(rows, level, np.array([slot], dtype=np.int64), None)

    def inline_restore(self, device: str) -> TransferHandler:
        """The inline CPU->GPU handler of a pool's ``device`` (the default one's otherwise)."""
        return self.inline_restores.get(device) or self.inline_restores[str(self.device)]

    def device_of(self, pool_id: PoolId) -> str | None:
        """A pool's device, read without the lock (None: no such pool; the caller's checks
        under the lock report it)."""
        pool = self.pools.get(pool_id)
        return pool.dev.device if pool is not None else None

    def complete(
        self, batch: Moves, results: list[bool], seconds: float, *, wait: bool = True
    ) -> bool:
        """See ``Completion.complete`` (takes the lock)."""
        return self.completion.complete(batch, results, seconds, wait=wait)

    def cancel(self, rows: np.ndarray) -> np.ndarray:
        """See ``Starter.cancel``."""
        return self.starts.cancel(rows)

    def wake_all(self) -> None:
        """Wake every waiter (lock held): the engine is closing."""
        self.cond.notify_all()
        self.landings.wake()

