"""Training offload built on the kvtier tiers: activations, gradients, optimizer states."""

from __future__ import annotations

from kvtier.training.activations import (
    ManualOffloadSynchronizer,
    OffloadStats,
    get_cpu_offload_context,
    mark_not_offload,
    offload_modules,
)
from kvtier.training.gradients import GradientOffloader
from kvtier.training.optimizer import OffloadedOptimizer

__all__ = [
    "GradientOffloader",
    "ManualOffloadSynchronizer",
    "OffloadStats",
    "OffloadedOptimizer",
    "get_cpu_offload_context",
    "mark_not_offload",
    "offload_modules",
]
