"""Training offload built on the kvtier tiers: activations, gradients, optimizer states."""

from __future__ import annotations

from kvtier.training.activations import (
    ManualOffloadSynchronizer,
    OffloadStats,
    get_cpu_offload_context,
    mark_not_offload,
    offload_modules,
)

__all__ = [
    "ManualOffloadSynchronizer",
    "OffloadStats",
    "get_cpu_offload_context",
    "mark_not_offload",
    "offload_modules",
]
