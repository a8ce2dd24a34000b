"""Shutdown flush: keyed pages in the CPU tier go to disk so a clean restart finds them.

Contract: ``flush_keyed(core, seconds)`` runs while the engine closes, before the scheduler stops.
With a medium below the CPU whose records survive a restart (``Placement.record_level``: the
disk store, wherever the chain puts it) and disk admission other than ``never``, every settled,
unprotected keyed page in the CPU tier is moved straight to that medium (the admission rule is
not asked: the alternative is losing it), using its free slots first, then room made by its
policy (only keyed pages survive a restart, so little of value is given up for them); a page
read up from that medium whose copy is still there settles on it again (``Placement``'s copies:
no write, no new record). Tenants'
disk quotas hold: what a quota refuses is dropped as ``tenant_quota``, as the cascade does. It
waits at most ``seconds``: moves still queued then are cancelled (their pages stay in the CPU
tier and die with the process). Pages left in the CPU tier are counted as ``shutdown`` drops and
logged. The disk store journals the records of the pages that land, so they survive the exit; the
flush then syncs them (``persist``) and reports as written only pages whose records a restart
will see: the medium's record changes in no file yet (``unindexed_records``: a full disk refused
the journal) are counted as ``unindexed`` and logged as an error, since a restart finds them only
if the index is saved at close.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.state.table import EMPTY, by_value
from kvtier.types import Direction, Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class FlushResult:
    keyed: int  # keyed pages in the CPU tier when the flush began
    flushed: int  # of those, pages now on disk
    lost: int  # pages still in the CPU tier (counted as ``shutdown`` drops; quota drops aside)
    unindexed: int = 0  # of ``flushed``, at most this many whose records are in no file yet


def flush_keyed(core: EngineCore, seconds: float) -> FlushResult:
    """Move keyed CPU-tier pages to disk within ``seconds`` (see the module contract)."""
    if core.record_level is None or core.config.disk_admission == "never":
        return FlushResult(0, 0, 0)
    deadline = time.monotonic() + max(0.0, seconds)
    t = core.table
    with core.cond:
        rows = _keyed_cpu_rows(core)
        moving = [_start(core, part, size) for size, part in _by_size(core, rows)]
        started = np.concatenate(moving) if moving else EMPTY
        while t.moving_down(started).any() and time.monotonic() < deadline:
            core.cond.wait(0.01)
        late = started[t.moving_down(started)]
        if len(late):
            core.cancel(late)  # queued ones come back; ones under way land after we stop waiting
        flushed = int(t.below_cpu(started).sum())
        left = int((t.at(rows, Tier.CPU) | t.moving_down(rows)).sum())  # not dropped by a quota
    result = FlushResult(len(rows), flushed, left, _unindexed(core, flushed))
    if result.unindexed:
        log.error(
            "shutdown: %d keyed CPU-tier pages written to disk, but the disk index refused the "
            "records of up to %d of them (disk full?): only %d are sure to be found after a "
            "restart", result.flushed, result.unindexed, result.flushed - result.unindexed,
        )
    if result.lost:
        with core.cond:
            core.counters.drop("shutdown", result.lost)
        log.warning(
            "shutdown: %d of %d keyed CPU-tier pages not written to disk (no room or no time)",
            result.lost, result.keyed,
        )
    elif result.keyed and not result.unindexed:
        log.info("shutdown: %d keyed CPU-tier pages written to disk", result.flushed)
    return result


def _unindexed(core: EngineCore, flushed: int) -> int:
    """Of ``flushed`` pages, at most how many have records no file holds after a sync."""
    level = core.record_level
    assert level is not None
    disk = core.media[level]
    if not flushed:
        return 0
    disk.persist()  # the records of the pages that landed: in the file and on the disk
    return min(flushed, disk.unindexed_records())


def _keyed_cpu_rows(core: EngineCore) -> np.ndarray:
    t = core.table
    keyed = np.fromiter(t.key_of.keys(), dtype=np.int64, count=len(t.key_of))
    keep = t.at(keyed, Tier.CPU) & (t.protect[keyed] == 0) & (t.waiting[keyed] == 0)
    return np.sort(keyed[keep])


def _by_size(core: EngineCore, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    return [(size, rows[pos]) for size, pos in by_value(core.table.size[rows])]


def _start(core: EngineCore, rows: np.ndarray, page_size: int) -> np.ndarray:
    """Queue the moves of as many of ``rows`` as the disk takes; the rows started."""
    level = core.record_level
    assert level is not None
    if core.ledger.active:  # tenants' disk quotas hold at shutdown too
        rows = core.cascade.fit_quotas(level, rows, page_size)
    copied = core.has_copy(rows, page_size)
    if copied.any():  # their bytes and records are on disk already: they settle there again
        core.settle_on_copies(rows[copied], page_size)
        return np.concatenate([rows[copied], _start_moves(core, rows[~copied], page_size)])
    return _start_moves(core, rows, page_size)


def _start_moves(core: EngineCore, rows: np.ndarray, page_size: int) -> np.ndarray:
    level = core.record_level
    assert level is not None
    if not len(rows):
        return rows
    disk = core.media[level]
    slots = disk.alloc(page_size, len(rows))
    if slots is None:
        owners = np.unique(core.table.owner[rows])
        core.cascade.make_room(level, page_size, len(rows), owners)
        slots = disk.alloc(page_size, len(rows))
    if slots is None:  # as many as there are
        slots = []
        while len(slots) < len(rows) and (one := disk.alloc(page_size, 1)):
            slots += one
    rows = rows[: len(slots)]
    if len(rows):
        dsts = np.array(slots, dtype=np.int64)
        core.starts.start_many(rows, Direction((Tier.CPU, level)), dsts, urgent=False)
    return rows
