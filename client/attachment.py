"""What an engine holds after Attach/Register: the pool's identity and its mapped memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.v1 import kvtier_pb2 as pb

from . import ipc
from .fastlane import FastLaneClient


@dataclass(slots=True)
class Attachment:
    """A pool of ``num_slots`` pages of ``page_size`` bytes.

    ``tensor`` is ``[num_slots, page_size]`` uint8 on the daemon's device, mapped to the daemon's
    memory: write KV bytes into the rows of slots you hold pinned. ``None`` for registered pools
    (the engine already owns that memory). ``instance`` names the daemon that created the pool.
    """

    pool_id: int
    tenant: str
    page_size: int
    num_slots: int
    instance: str
    device: str
    tensor: torch.Tensor | None
    request: Any = field(repr=False)  # the Attach/Register request, for reattach()
    keepalive: list[Any] = field(default_factory=list, repr=False)
    fast_lane: FastLaneClient | None = field(default=None, repr=False)


def from_reply(reply: pb.AttachReply, tenant: str, request: Any, *, register: bool) -> Attachment:
    h = reply.handle
    tensor = None if register else map_pool(h, reply.num_slots, reply.page_size)
    return Attachment(
        pool_id=reply.pool_id, tenant=tenant, page_size=reply.page_size,
        num_slots=reply.num_slots, instance=reply.instance, device=h.device, tensor=tensor,
        request=request, fast_lane=_lane(reply),
    )


def _lane(reply: pb.AttachReply) -> FastLaneClient | None:
    lane = reply.fast_lane
    if not reply.HasField("fast_lane") or not lane.path or len(lane.capability) != 16:
        return None
    return FastLaneClient(lane.path, lane.capability)


def map_pool(h: pb.PoolHandle, num_slots: int, page_size: int) -> torch.Tensor:
    """Map a daemon pool with the tier's own opener (CUDA IPC or /dev/shm)."""
    from kvtier.tiers.base import PoolHandle
    from kvtier.tiers.device import open_handle

    kinds = {pb.HANDLE_KIND_SHM: "shm", pb.HANDLE_KIND_CUDA_IPC: "cuda_ipc"}
    if h.kind not in kinds:
        raise ValueError(f"unknown pool handle kind {h.kind}")
    return open_handle(PoolHandle(kinds[h.kind], num_slots, page_size, h.device, h.shm_path,
                                  h.ipc))


def segment(t: torch.Tensor, shm_path: str = "") -> pb.Segment:
    """Describe one engine-owned ``[num_slots, slot_bytes]`` uint8 tensor for Register."""
    if t.dim() != 2 or t.dtype != torch.uint8 or t.stride(1) != 1:
        raise ValueError("segments must be 2-D uint8 tensors with contiguous rows")
    seg = pb.Segment(num_slots=t.shape[0], slot_bytes=t.shape[1], slot_stride=t.stride(0),
                     offset=int(t.storage_offset()))
    if t.is_cuda:
        seg.ipc = ipc.encode_cuda(t.untyped_storage())
    else:
        if not shm_path:
            raise ValueError("CPU segments need the /dev/shm file that backs them")
        seg.shm_path = shm_path
    return seg
