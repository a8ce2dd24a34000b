"""Transfer handlers, one per medium pair (``registry.py``); ``build_handlers`` picks them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.transfer.base import Moves, TransferHandler
from kvtier.transfer.registry import RouteContext
from kvtier.transfer.registry import build_handlers as _build
from kvtier.types import Direction

if TYPE_CHECKING:
    from kvtier.tiers.medium import SlotMedium
    from kvtier.tiers.pinned import HostArena

__all__ = ["Moves", "TransferHandler", "build_handlers", "build_inline_restore"]


def build_handlers(
    device: torch.device,
    host: HostArena,
    media: Sequence[tuple[str, SlotMedium]],
    staging_bytes: int,
    flush_to: int | None = None,
) -> dict[Direction, TransferHandler]:
    """The registered handler of each move along the chain: GPU<->CPU for ``device``, and
    between the CPU and the slot ``media`` below it (``(name, medium)``, top down; see
    ``registry.build_handlers``)."""
    return _build(RouteContext(device, host, None, None, staging_bytes), media, flush_to)


def build_inline_restore(
    device: torch.device, host: HostArena, staging_bytes: int
) -> TransferHandler:
    """A second CPU->GPU handler (own stream and staging) for small restores run by the
    acquiring thread itself, beside the scheduler's up lane."""
    if device.type == "cuda":
        from kvtier.transfer.cuda import CudaRestore

        return CudaRestore(host, device, staging_bytes, inline=True)
    from kvtier.transfer.host import HostRestore

    return HostRestore(host)
