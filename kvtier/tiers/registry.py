"""Slot media by name: how the tier chain's media below the CPU are opened.

Contract:
    * ``register_medium(name, open_fn, tier=Tier.DISK, keeps_records=False)``:
      ``open_fn(config)`` returns the medium, or None when the configuration leaves it off
      (``disk`` without a budget); ``tier`` is what the wire reports for pages there (Lookup,
      PageInfo, Stats); ``keeps_records``: its keyed pages' records survive a restart (the
      shutdown flush writes keyed CPU pages to the first such medium). Names are lowercase
      identifiers; registering a name again replaces it (a test double).
    * ``open_chain(config)`` -> the open media below the CPU, top down, one ``ChainMedium``
      each, for ``config.tier_chain[2:]``: a medium the configuration leaves off is skipped (the
      chain closes up). An unknown name is a ``ConfigError`` naming
      ``KVCACHED_OFFLOAD_TIER_CHAIN`` and the registered names, raised before anything opens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import ENV_PREFIX, OffloadConfig
from kvtier.errors import ConfigError
from kvtier.tiers.medium import SlotMedium
from kvtier.types import Tier

OpenMedium = Callable[[OffloadConfig], SlotMedium | None]
_MEDIA: dict[str, tuple[OpenMedium, Tier, bool]] = {}


@dataclass(slots=True, frozen=True)
class ChainMedium:
    """An open medium of the chain: its registered name, the store, its wire ``Tier``, whether
    its records survive a restart."""

    name: str
    store: SlotMedium
    tier: Tier
    keeps_records: bool = False


def register_medium(
    name: str, open_fn: OpenMedium, tier: Tier = Tier.DISK, *, keeps_records: bool = False
) -> None:
    _MEDIA[name] = (open_fn, tier, keeps_records)


def media() -> list[str]:
    return sorted(_MEDIA)


def open_chain(config: OffloadConfig) -> list[ChainMedium]:
    names = config.tier_chain[2:]
    for name in names:
        if name not in _MEDIA:
            raise ConfigError(
                f"{ENV_PREFIX}TIER_CHAIN={','.join(config.tier_chain)!r} names an unknown "
                f"medium {name!r}; accepted below cpu: {', '.join(media())}"
            )
    opened: list[ChainMedium] = []
    for name in names:
        open_fn, tier, keeps = _MEDIA[name]
        store = open_fn(config)
        if store is not None:
            opened.append(ChainMedium(name, store, tier, keeps))
    return opened


def _open_disk(config: OffloadConfig) -> SlotMedium | None:
    if not config.disk_budget_bytes:
        return None
    from kvtier.tiers.disk import DiskStore

    return DiskStore(
        config.disk_path,
        config.disk_budget_bytes,
        direct_io=config.disk_direct_io,
        io_threads=config.disk_io_threads,
    )


register_medium("disk", _open_disk, keeps_records=True)
