"""The prefix store's side of the remote tier: stored blocks go out, remote hits come in.

Contract (nothing here touches the network):
    * ``hold(core, rows) -> Held`` (engine lock held): the CPU-resident keyed pages among
      ``rows`` that the remote tier wants (not known to be in the store), protected so they
      stay where they are; ``offer(core, held)`` (engine lock NOT held) copies their bytes into
      framed values, offers them to the write-behind queue, then unprotects them. The copy runs
      without the engine lock, so acquires and loads never wait for it.
    * ``land(core, tenant, salted, payloads, page_size)`` makes verified remote payloads CPU keyed
      pages of ``tenant`` (as a disk hit is restored to CPU), skipping keys stored locally
      meanwhile; returns how many landed (fewer when the CPU tier has no room).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.pagetable import S_CPU
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore


Held = list[tuple[int, bytes, int, int]]  # (row, salted key, page size, CPU slot)


def hold(core: EngineCore, rows: np.ndarray) -> Held:
    remote, t = core.remote, core.table
    if remote is None or not len(rows):
        return []
    held: Held = []
    for row in rows[t.state[rows] == S_CPU].tolist():
        salted = t.key_of.get(row)
        if salted is not None and remote.wants(salted):
            held.append((row, salted, int(t.size[row]), int(t.slot[row])))
    if held:
        core.protect(np.array([h[0] for h in held], dtype=np.int64))
    return held


def offer(core: EngineCore, held: Held) -> int:
    remote = core.remote
    if remote is None or not held:
        return 0
    try:
        items: list[tuple[bytes, bytearray]] = []
        if core.closed:  # the host tier is being released: nothing to copy from
            return 0
        for _, salted, size, slot in held:
            buf, body = remote.frame_buffer(salted, size)
            np.frombuffer(body, dtype=np.uint8)[:] = core.host.rows(size, [slot])[0].numpy()
            items.append((salted, buf))
        return remote.offer(items)
    finally:
        with core.cond:
            core.unprotect(np.array([h[0] for h in held], dtype=np.int64))


def land(
    core: EngineCore, tenant: str, salted: Sequence[bytes], payloads: Sequence[memoryview],
    page_size: int,
) -> int:
    t = core.table
    todo = [(k, p) for k, p in zip(salted, payloads, strict=False) if t.keyed(k) is None]
    if not todo:
        return 0
    slots = core.cascade.cpu_slots(page_size, len(todo))
    todo = todo[: len(slots)]
    if not todo:
        return 0
    rows = t.new_rows(len(todo))
    t.size[rows], t.prio[rows], t.length[rows] = page_size, 1.0, 1
    views = core.host.rows(page_size, slots.tolist())
    for row, (key, payload), view in zip(rows.tolist(), todo, views, strict=True):
        view.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        t.add_key(row, key, tenant)
    core.settle(rows, Tier.CPU, slots, None)
    return len(rows)
