"""Per-tenant shares of the tiers: the quota setting, the byte ledger and the share rule.

Contract:
    * ``parse_quotas(text)`` reads ``KVCACHED_OFFLOAD_TENANT_QUOTAS``:
      ``tenant=tier:size[,tier:size...][;tenant=...]`` with tiers ``gpu``, ``cpu``, ``disk`` and
      ``*`` as the default entry for tenants not named. A tier left out of an entry has no quota
      for that tenant. ``ValueError`` (the config names the variable) on anything else.
    * ``TenantLedger`` is owned by the engine core (one instance, mutated under the engine lock).
      Each page-table row carries an ``owner`` id (``ledger.owner(tenant)``; 0 = no tenant).
      Per tier it counts, per tenant, the bytes *settled* there (every page the tier's policy
      tracks: ``settle`` adds, ``unsettle`` subtracts) and the bytes *incoming* (destination
      slots of moves in flight into the tier: charged when the move is prepared, discharged
      when it completes or fails). ``used(tier)`` = settled + incoming: what the tenant holds.
      Every update is one ``bincount`` per batch, never Python per page.
    * The share rule, kept out of the policies (they only name victims; ``kvtier.moves.demotion``
      applies it): a tenant's ``room`` in a tier is its quota minus its use (``None`` without a
      quota); ``evictable`` is the per-tenant mask of pages other tenants may displace: tenants
      over their quota, and every tenant without one. A tenant within its quota is never
      displaced for another (one at its quota is capped and makes room from its own pages).
    * ``quota(tenant)`` reads the setting without assigning an owner id (a refused call can't
      grow the ledger); ids are assigned when a tenant's first page is created.
    * It also keeps the per-tenant counters of a tenant's Stats view (moves, hits, evictions,
      drops), arrays by owner id, updated per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.types import Direction, Tier
from kvtier.validate import check_name

TIERS = {"gpu": Tier.GPU, "cpu": Tier.CPU, "disk": Tier.DISK}
DEFAULT = "*"
DIRECTIONS = {d: i for i, d in enumerate(Direction)}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True, slots=True)
class Quota:
    """Bytes a tenant may hold per tier; ``None`` = no quota there."""

    gpu: int | None = None
    cpu: int | None = None
    disk: int | None = None

    def of(self, tier: Tier) -> int | None:
        return self.sizes()[int(tier)]

    def sizes(self) -> tuple[int | None, ...]:
        """One entry per :class:`Tier`, in order; the remote tier has no quota (the shared
        store's TTL and maxmemory policy bound it)."""
        return self.gpu, self.cpu, self.disk, None


def _size(text: str) -> int:
    body = text.strip().lower().removesuffix("b").removesuffix("i")
    digits = body.rstrip("kmgt")
    unit = body[len(digits):]
    if not digits.isdigit() or len(unit) > 1:
        raise ValueError(f"not a size: {text!r}")
    return int(digits) * _UNITS[unit]


def parse_quotas(text: str) -> dict[str, Quota]:
    """``tenant -> Quota`` from the setting's text (see the module docstring)."""
    out: dict[str, Quota] = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        tenant, eq, spec = entry.partition("=")
        tenant = tenant.strip()
        if not eq or not tenant or tenant in out:
            raise ValueError(f"bad or repeated entry {entry!r}")
        if tenant != DEFAULT:
            try:
                check_name("tenant", tenant)
            except InvalidArgument:
                raise ValueError(f"not a tenant name: {tenant!r}") from None
        sizes: dict[str, int] = {}
        for part in spec.split(","):
            tier, colon, size = part.partition(":")
            tier = tier.strip().lower()
            if not colon or tier not in TIERS or tier in sizes:
                raise ValueError(f"bad tier in {entry!r}: {part.strip()!r}")
            sizes[tier] = _size(size)
        out[tenant] = Quota(**sizes)
    return out


class TenantLedger:
    """Per-tenant bytes per tier, and the rule over them. See the module docstring."""

    def __init__(self, quotas: dict[str, Quota]) -> None:
        self.quotas = quotas
        self.active = bool(quotas)
        self.names: list[str] = [""]  # owner id -> tenant; 0 = no tenant
        self._ids: dict[str, int] = {}
        self.limit = np.full((len(Tier), 1), -1, dtype=np.int64)  # -1: no quota
        self.settled = np.zeros((len(Tier), 1), dtype=np.int64)
        self.incoming = np.zeros((len(Tier), 1), dtype=np.int64)
        self.moved_pages = np.zeros((len(Direction), 1), dtype=np.int64)
        self.moved_bytes = np.zeros((len(Direction), 1), dtype=np.int64)
        self.hits = np.zeros((len(Tier), 1), dtype=np.int64)
        self.evictions = np.zeros((len(Tier), 1), dtype=np.int64)
        self.misses = np.zeros(1, dtype=np.int64)
        self.drops: dict[str, np.ndarray] = {}

    # -- owners ---------------------------------------------------------------------------------
    def owner(self, tenant: str) -> int:
        """The owner id of ``tenant`` (assigned on first use)."""
        got = self._ids.get(tenant)
        if got is not None:
            return got
        got = self._ids[tenant] = len(self.names)
        self.names.append(tenant)
        if got == self.limit.shape[1]:
            self._grow()
        limits = [-1 if q is None else q for q in self.quota(tenant).sizes()]
        self.limit[:, got] = limits
        return got

    def _grow(self) -> None:
        """Twice the columns (unused ones zero, no quota): a new tenant copies the arrays only
        at a power of two, not each time (one client naming tenants at will made every new
        name copy every array: quadratic)."""
        width = self.limit.shape[1]
        self.limit = np.concatenate([self.limit, np.full_like(self.limit, -1)], 1)
        for name in ("settled", "incoming", "moved_pages", "moved_bytes", "hits", "evictions"):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.zeros_like(old)], 1))
        self.misses = np.concatenate([self.misses, np.zeros(width, dtype=np.int64)])
        for reason, arr in self.drops.items():
            self.drops[reason] = np.concatenate([arr, np.zeros(width, dtype=np.int64)])

    def quota(self, tenant: str) -> Quota:
        """``tenant``'s quota (its entry, else ``*``'s, else none); assigns no owner id, so a
        caller naming tenants at will (a refused Attach) can't grow the ledger."""
        return self.quotas.get(tenant, self.quotas.get(DEFAULT, Quota()))

    def find(self, tenant: str) -> int:
        """The owner id of ``tenant``, 0 when it has never held anything."""
        return self._ids.get(tenant, 0)

    def per_owner(self, owners: np.ndarray, weight: int = 1) -> np.ndarray:
        """``weight`` times the count of each owner id in ``owners`` (one bincount)."""
        return np.bincount(owners, minlength=self.limit.shape[1]) * weight

    # -- bytes ------------------------------------------------------------------------------------
    def used(self, tier: Tier) -> np.ndarray:
        """Bytes each owner holds in ``tier`` (settled + incoming)."""
        t = int(tier)
        return self.settled[t] + self.incoming[t]

    def room(self, tier: Tier, owner: int) -> int | None:
        """Bytes ``owner`` may still take in ``tier``; ``None`` = no quota."""
        limit = int(self.limit[int(tier), owner])
        return None if limit < 0 else max(0, limit - int(self.used(tier)[owner]))

    def evictable(self, tier: Tier) -> np.ndarray:
        """Per owner: may its pages in ``tier`` be displaced for another tenant? (Over its
        quota, or without one.)"""
        t = int(tier)
        return (self.limit[t] < 0) | (self.used(tier) > self.limit[t])

    # -- counters ---------------------------------------------------------------------------------
    def count_moved(self, direction: Direction, owners: np.ndarray, page_size: int) -> None:
        """Per wire direction (``Direction.wire``: a restore from any medium below the CPU is
        DISK_TO_CPU); a move between two media below the CPU is counted daemon-wide only."""
        wire = direction.wire
        if wire is None:
            return
        pages = self.per_owner(owners)
        self.moved_pages[DIRECTIONS[wire]] += pages
        self.moved_bytes[DIRECTIONS[wire]] += pages * page_size

    def drop(self, reason: str, owners: np.ndarray) -> None:
        arr = self.drops.get(reason)
        if arr is None:
            arr = self.drops[reason] = np.zeros(self.limit.shape[1], dtype=np.int64)
        arr += self.per_owner(owners)
