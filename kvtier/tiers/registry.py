"""Slot media by name: how the tier chain's medium below the CPU is opened.

Contract:
    * ``register_medium(name, open_fn)``: ``open_fn(config)`` returns the medium, or None when
      the configuration leaves it off (``disk`` without a budget). Names are lowercase
      identifiers; registering a name again replaces it (a test double).
    * ``open_lower(config)`` -> ``(name, medium | None)`` for ``config.tier_chain[2]`` (``("",
      None)`` for a chain that ends at the CPU); an unknown name is a ``ConfigError`` naming
      ``KVCACHED_OFFLOAD_TIER_CHAIN`` and the registered names.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.config import ENV_PREFIX, OffloadConfig
from kvtier.errors import ConfigError
from kvtier.tiers.medium import SlotMedium

OpenMedium = Callable[[OffloadConfig], SlotMedium | None]
_MEDIA: dict[str, OpenMedium] = {}


def register_medium(name: str, open_fn: OpenMedium) -> None:
    _MEDIA[name] = open_fn


def media() -> list[str]:
    return sorted(_MEDIA)


def open_lower(config: OffloadConfig) -> tuple[str, SlotMedium | None]:
    if len(config.tier_chain) < 3:
        return "", None
    name = config.tier_chain[2]
    open_fn = _MEDIA.get(name)
    if open_fn is None:
        raise ConfigError(
            f"{ENV_PREFIX}TIER_CHAIN={','.join(config.tier_chain)!r} names an unknown medium "
            f"{name!r}; accepted below cpu: {', '.join(media())}"
        )
    return name, open_fn(config)


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


register_medium("disk", _open_disk)
