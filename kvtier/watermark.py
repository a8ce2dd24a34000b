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

from kvtier.core import EngineCore
from kvtier.pool import Pool, Protected
from kvtier.types import PageState

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
            if core.disk is not None and time.monotonic() - last_persist > PERSIST_EVERY_S:
                core.disk.persist()  # bounds what a kill -9 can lose of the keyed-page index
                last_persist = time.monotonic()
            if not core.config.enabled:
                continue
            with core.cond:
                if core.closed:
                    return
                for pool in list(core.pools.values()):
                    self.check(pool)

    def check(self, pool: Pool) -> None:
        cfg = self._core.config
        used = pool.used_slots - pool.moving_down
        if used > cfg.threshold * pool.num_slots:
            excess = used - math.floor(cfg.low_watermark * pool.num_slots)
            evictable = len(pool.policy) - len(pool.pinned)
            n = min(excess, evictable)
            victims = pool.policy.evict(n, Protected(pool.pinned)) if n > 0 else None
            pages = [self._core.table.pages[v] for v in victims or []]
            for page in pages:
                pool.policy.insert(page.meta())
            self._core.offload(pages)
        elif cfg.prefetch and used < cfg.low_watermark * pool.num_slots:
            room = math.floor(cfg.low_watermark * pool.num_slots) - used
            cold = [p for p in self._core.table.of_pool(pool.pool_id) if p.state is PageState.CPU]
            cold.sort(key=lambda p: p.page_id, reverse=True)
            if cold and room > 0:
                self._core.restore_cpu(pool, cold[:room], urgent=False)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
