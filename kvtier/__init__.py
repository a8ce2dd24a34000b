"""kvtier: a KV-cache tiering engine (GPU -> pinned CPU -> disk) and daemon.

``configure_offload(OffloadConfig(...))`` returns an in-process :class:`TierEngine`; the daemon
(``kvtier serve``) wraps the same engine behind gRPC.
"""

from __future__ import annotations

from kvtier.config import OffloadConfig
from kvtier.engine import PageInfo, TierEngine, configure_offload
from kvtier.types import PageId, PageState, PoolId, SlotIndex, Tier

__version__ = "0.1.0"
__all__ = [
    "OffloadConfig",
    "PageId",
    "PageInfo",
    "PageState",
    "PoolId",
    "SlotIndex",
    "Tier",
    "TierEngine",
    "__version__",
    "configure_offload",
]
