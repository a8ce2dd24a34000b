"""Client of the kvtier daemon.

``connect(address="unix:///...", tenant=..., token=None, timeout=5.0) -> KVTierClient`` (blocking)
and ``connect_async(...) -> AsyncKVTierClient`` (asyncio) expose the same methods: attach/register/
reattach/detach, allocate/free/acquire/release/offload/prefetch/set_priority, store/lookup/load,
stats, watch_events. Errors are ``kvtier.errors`` classes.

The vLLM connector and the transformers cache live in ``kvtier.integrations``; their old paths
here (``kvtier.client.vllm_connector``, ``hf_cache``, ``hf_static``) still import them.
"""

from __future__ import annotations

from . import _moved
from .aio import AsyncKVTierClient, connect_async
from .attachment import Attachment
from .errors import PermissionDenied, Unauthenticated
from .sync import KVTierClient, connect

_moved.install()

__all__ = [
    "AsyncKVTierClient", "Attachment", "KVTierClient", "PermissionDenied", "Unauthenticated",
    "connect", "connect_async",
]
