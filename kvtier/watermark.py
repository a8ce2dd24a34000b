"""Watermarks: keep free GPU slots ahead of demand, and prefetch back when there is room.

Contract: a background thread checks every pool every ``interval`` seconds (and whenever the engine
notifies). A pool above ``threshold`` use gets its coldest unpinned pages offloaded until it would
be at ``low_watermark``. With ``prefetch`` on, a pool below ``low_watermark`` gets its most recently
CPU pages (newest first) restored, never past ``low_watermark``. It never evicts to prefetch.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from kvtier.core import EngineCore
from kvtier.pool import Pool
from kvtier.types import Tier

PERSIST_EVERY_S = 2.0


class Watermarks:
    def __init__(self, core: EngineCore, interval: float = 0.02) -> None:
        self._core = core
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-watermarks", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        core = self._core
        last_persist = time.monotonic()
        while not self._stop.wait(self._interval):
            if core.media and time.monotonic() - last_persist > PERSIST_EVERY_S:
                for medium in core.media.values():  # bounds what a kill -9 can lose of the
                    medium.persist()  # keyed-page index
                last_persist = time.monotonic()
            if not core.config.enabled:
                continue
            with core.cond:
                if core.closed:
                    return
                for pool in list(core.pools.values()):
                    self.check(pool)

    def check(self, pool: Pool) -> None:
        core, cfg, t = self._core, self._core.config, self._core.table
        used = pool.used_slots - pool.moving_down
        if used > cfg.threshold * pool.num_slots:
            excess = used - math.floor(cfg.low_watermark * pool.num_slots)
            victims = pool.policy.evict(excess, lambda r: t.pins[r] > 0, partial=True)
            if victims is not None and len(victims):
                pool.policy.insert(victims, core.meta(victims))  # ``offload`` takes them out
                core.starts.offload(victims)
        elif cfg.prefetch and used < cfg.low_watermark * pool.num_slots:
            room = math.floor(cfg.low_watermark * pool.num_slots) - used
            rows = t.of_pool(pool.pool_id)
            cold = rows[t.at(rows, Tier.CPU)]
            if len(cold) and room > 0:
                newest = cold[np.argsort(-t.ids(cold), kind="stable")]
                core.starts.restore_cpu(pool, newest[:room], urgent=False)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
