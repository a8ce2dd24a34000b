"""The prefix store's side of the remote tier: stored blocks go out, remote hits come in.

Contract (nothing here touches the network):
    * ``hold(core, rows, fresh=False) -> Held`` (engine lock held): the CPU-resident keyed
      pages among ``rows`` that the remote tier wants (not known to be in the store; ``fresh``:
      every one, for pages a Store just made: what was known may have been lost since, and
      whatever held the block before is gone here too), protected so they
      stay where they are; ``offer(core, held)`` (engine lock NOT held) copies their bytes into
      framed values, offers them to the write-behind queue ``OFFER_BYTES`` at a time (its
      threads send a batch while the next is copied), then unprotects them. The copy runs
      without the engine lock, so acquires and loads never wait for it.
    * ``Stager.take`` reserves CPU slots for verified remote payloads a
      batch at a time, as the fetch hands them over, and copies them in without the engine
      lock; ``land`` (lock held) makes them CPU keyed pages of the tenant (as a disk hit
      is restored to CPU), freeing the slots of keys stored locally meanwhile; ``unstage``
      frees a staging that is not landed.
    * Staged slots are the loading tenant's from the moment they are reserved: its CPU quota
      bounds them (its own pages make the room), and they count as its incoming CPU bytes
      until ``land`` settles them as its pages or ``unstage`` frees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore


Held = list[tuple[int, bytes, int, int, str]]  # (row, salted key, page size, CPU slot, tenant)


def hold(core: EngineCore, rows: np.ndarray, fresh: bool = False) -> Held:
    remote, t = core.remote, core.table
    if remote is None or not len(rows):
        return []
    held: Held = []
    for row in rows[t.at(rows, Tier.CPU)].tolist():
        salted = t.key_of.get(row)
        if salted is not None and (fresh or remote.wants(salted)):
            held.append((row, salted, int(t.size[row]), int(t.slot[row]),
                         t.tenant_of.get(row, "")))
    if held:
        core.protect(np.array([h[0] for h in held], dtype=np.int64))
    return held


OFFER_BYTES = 8 << 20  # values handed to the write-behind at a time: it sends while we copy


def offer(core: EngineCore, held: Held) -> int:
    remote = core.remote
    if remote is None or not held:
        return 0
    offered = 0
    try:
        items: list[tuple[bytes, bytearray]] = []
        pending, owner = 0, held[0][4]
        for _, salted, size, slot, tenant in held:
            if core.closed:  # the host tier is being released: nothing to copy from
                break
            if tenant != owner or pending >= OFFER_BYTES:  # one tenant's items per offer
                offered += remote.offer(items, owner) if items else 0
                items, pending, owner = [], 0, tenant
            buf, body = remote.frame_buffer(salted, size)
            np.frombuffer(body, dtype=np.uint8)[:] = core.host.rows(size, [slot])[0].numpy()
            items.append((salted, buf))
            pending += size
        return offered + (remote.offer(items, owner) if items else 0)
    finally:
        with core.cond:
            core.unprotect(np.array([h[0] for h in held], dtype=np.int64))


@dataclass(slots=True)
class Staged:
    """Remote payloads copied into reserved CPU slots, not yet pages (nobody else sees them)."""

    tenant: str
    owner: int  # the tenant's ledger id: the staged bytes are its incoming CPU bytes
    page_size: int
    salted: list[bytes]
    slots: np.ndarray


class Stager:
    """Verified remote payloads copied into CPU slots as they arrive (``take`` per batch):
    slots are reserved a batch at a time (engine lock taken briefly), the copy runs without it.
    ``staged(salted)`` is the result for the caller to land or free (None: nothing taken)."""

    def __init__(self, core: EngineCore, tenant: str, owner: int, page_size: int) -> None:
        """``owner``: ``tenant``'s ledger id (``TenantLedger.owner``, taken under the lock)."""
        self.core, self.tenant, self.owner, self.page_size = core, tenant, owner, page_size
        self.slots: list[np.ndarray] = []

    def take(self, payloads: Sequence[memoryview]) -> int:
        core = self.core
        with core.cond:
            if core.closed:
                return 0
            slots = core.cascade.cpu_slots(self.page_size, len(payloads), self.owner)
            _charge(core, self.owner, len(slots) * self.page_size)
        if not len(slots):
            return 0
        for payload, view in zip(payloads, core.host.rows(self.page_size, slots.tolist()),
                                 strict=False):
            view.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        self.slots.append(slots)
        return len(slots)

    def staged(self, salted: Sequence[bytes]) -> Staged | None:
        if not self.slots:
            return None
        slots = np.concatenate(self.slots)
        return Staged(self.tenant, self.owner, self.page_size, list(salted[: len(slots)]), slots)


def _charge(core: EngineCore, owner: int, nbytes: int) -> None:
    """Staged bytes in (or, negative, out of) ``owner``'s incoming CPU bytes (lock held)."""
    core.ledger.incoming[int(Tier.CPU), owner] += nbytes


def land(core: EngineCore, staged: Staged) -> int:
    """Staged payloads become CPU keyed pages (engine lock held), as a disk hit is restored to
    CPU; a key stored locally meanwhile keeps its page and its staged slot is freed. Returns how
    many landed."""
    t = core.table
    _charge(core, staged.owner, -len(staged.slots) * staged.page_size)
    fresh = np.array([t.keyed(k) is None for k in staged.salted], dtype=bool)
    if not fresh.all():
        core.host.free_array(staged.page_size, staged.slots[~fresh])
    slots = staged.slots[fresh]
    if not len(slots):
        return 0
    rows = t.add(len(slots), pool=0, size=staged.page_size, owner=staged.owner)
    for row, key in zip(rows.tolist(), (k for k, f in zip(staged.salted, fresh.tolist(),
                                                            strict=True) if f), strict=True):
        t.add_key(row, key, staged.tenant)
    core.settle(rows, Tier.CPU, slots, None)
    return len(rows)


def unstage(core: EngineCore, staged: Staged) -> None:
    """Give back the slots of a staging that was not landed (engine lock held)."""
    _charge(core, staged.owner, -len(staged.slots) * staged.page_size)
    if not core.closed:
        core.host.free_array(staged.page_size, staged.slots)
