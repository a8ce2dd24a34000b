"""Transfer handlers, one per medium pair; ``build_handlers`` picks CUDA or CPU-mode ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction

if TYPE_CHECKING:
    from kvtier.tiers.disk import DiskStore
    from kvtier.tiers.pinned import HostArena

__all__ = ["Moves", "TransferHandler", "build_handlers", "build_inline_restore"]


def build_handlers(
    device: torch.device, host: HostArena, disk: DiskStore | None, staging_bytes: int
) -> dict[Direction, TransferHandler]:
    handlers: dict[Direction, TransferHandler] = {}
    if device.type == "cuda":
        from kvtier.transfer.cuda import CudaOffload, CudaRestore

        handlers[Direction.GPU_TO_CPU] = CudaOffload(host, device, staging_bytes)
        handlers[Direction.CPU_TO_GPU] = CudaRestore(host, device, staging_bytes)
    else:
        from kvtier.transfer.host import HostOffload, HostRestore

        handlers[Direction.GPU_TO_CPU] = HostOffload(host)
        handlers[Direction.CPU_TO_GPU] = HostRestore(host)
    if disk is not None:
        from kvtier.transfer.disk import DiskRead, DiskWrite

        handlers[Direction.CPU_TO_DISK] = DiskWrite(host, disk)
        handlers[Direction.DISK_TO_CPU] = DiskRead(host, disk)
    return handlers


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
