"""A stored prefix brought to the CPU tier and protected there, for a load or a borrow.

Contract:
    * ``resident(core, find, pool, salted, loan=None, patience=None) -> rows``: the rows of the
      longest stored prefix of ``salted`` (keys salted for ``pool``'s tenant; ``find(pool,
      salted)`` gives the stored prefix's rows wherever they are), every one of them
      in the CPU tier and protected (the caller unprotects them). Blocks below the CPU tier are
      read up; a ``loan`` is given back before waiting for them.
    * It returns a shorter, leading part (the blocks already in the CPU tier, in order) when the
      rest can't come: they got no slot and nothing under way will free one (``stuck``); or
      when a ``patience(landed) -> seconds`` says waiting longer does not pay: ``landed`` is how
      many leading blocks are in the CPU tier now, the answer how long after the call began it
      is still worth waiting for more (``kvtier.planner.Plan.patience``). Reads already
      started land like any restore; blocks that got no CPU slot yet stay where they are.
    * ``DeadlineExceeded`` past ``restore_timeout_s``; nothing stays protected on any error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import DeadlineExceeded
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.loan import LaneLoan
    from kvtier.state.pool import Pool

Patience = Callable[[int], float]  # leading blocks in the CPU tier -> seconds worth waiting
Find = Callable[["Pool", list[bytes]], np.ndarray]  # the stored prefix's rows
POLL_S = 0.05  # the longest wait between looks at the blocks (landings also wake it)


def _leading(on_cpu: np.ndarray) -> int:
    """How many leading entries are True."""
    return len(on_cpu) if on_cpu.all() else int(np.argmin(on_cpu))


def resident(core: EngineCore, find: Find, pool: Pool, salted: list[bytes],
             loan: LaneLoan | None = None, patience: Patience | None = None) -> np.ndarray:
    """See the module docstring."""
    t = core.table
    began = time.monotonic()
    deadline = began + core.config.restore_timeout_s
    rows = find(pool, salted)
    if t.at(rows, Tier.CPU).all():  # the common case: the whole prefix in the CPU tier
        core.protect(rows)
        return rows
    if loan is not None:
        loan.give_back()
    held: set[int] = set()
    try:
        while True:
            rows = find(pool, salted)
            on_cpu = t.at(rows, Tier.CPU)
            fresh = [r for r in rows[on_cpu].tolist() if r not in held]
            if fresh:
                core.protect(np.array(fresh, dtype=np.int64))
                held.update(fresh)
            lead = _leading(on_cpu)
            if lead == len(rows):
                return _keep(core, held, rows)
            on_disk, down = rows[t.below_cpu(rows)], rows[t.moving_down(rows)]
            if len(on_disk):
                core.starts.restore_below(on_disk)
            core.cancel(down)
            now = time.monotonic()
            worth = float("inf") if patience is None else began + patience(lead)
            if now >= worth or stuck(core, rows):  # the part already in the CPU tier
                return _keep(core, held, rows[:lead])
            if now > deadline:
                raise DeadlineExceeded("load: restoring stored blocks from disk timed out")
            core.cond.wait(min(POLL_S, max(worth - now, 1e-4)))
    except BaseException:
        core.unprotect(np.array(sorted(held), dtype=np.int64))
        raise


def _keep(core: EngineCore, held: set[int], rows: np.ndarray) -> np.ndarray:
    """``rows`` (all held), with every other held row unprotected."""
    core.unprotect(np.array(sorted(held.difference(rows.tolist())), dtype=np.int64))
    return rows


def stuck(core: EngineCore, rows: np.ndarray) -> bool:
    """No block of ``rows`` on its way up and no transfer under way: the blocks below the CPU
    tier got no slot there (every page in it is protected, or its tenant within its quota), and
    nothing running will free one."""
    restores, offloads = core.scheduler.depth()
    return not (core.table.moving(rows).any() or restores or offloads
                or core.scheduler.inflight_bytes)
