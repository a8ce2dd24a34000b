"""The prefix store's side of the remote tier: stored blocks go out, remote hits come in.

Contract (both functions run with the engine lock held and never touch the network):
    * ``offer_rows(core, rows)`` copies the bytes of CPU-resident keyed pages and offers them to
      the remote tier's write-behind queue; pages not in CPU, or known to be in the store already,
      are skipped. The copy is taken now, so the page may move or be freed right after.
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


def offer_rows(core: EngineCore, rows: np.ndarray) -> int:
    remote, t = core.remote, core.table
    if remote is None or not len(rows):
        return 0
    items: list[tuple[bytes, bytearray]] = []
    for row in rows[t.state[rows] == S_CPU].tolist():
        salted = t.key_of.get(row)
        if salted is None or not remote.wants(salted):
            continue
        size = int(t.size[row])
        buf, body = remote.frame_buffer(salted, size)
        np.frombuffer(body, dtype=np.uint8)[:] = core.host.rows(size, [int(t.slot[row])])[0].numpy()
        items.append((salted, buf))
    return remote.offer(items) if items else 0


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
