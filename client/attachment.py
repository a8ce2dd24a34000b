"""What an engine holds after Attach/Register: the pool's identity and its mapped memory."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import FailedPrecondition
from kvtier.v1 import kvtier_pb2 as pb

from . import ipc
from .fastlane import FastLaneClient
from .fdpass import Session


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
    memfds: list[int] = field(default_factory=list, repr=False)  # Register's fds, for reattach()
    lease: bytes = field(default=b"", repr=False)  # the lease ticket (a secret: never log it)
    fast_lane: FastLaneClient | None = field(default=None, repr=False)


def from_reply(reply: pb.AttachReply, tenant: str, request: Any, *, register: bool,
               session: Session | None = None, lane_timeout: float = 2.0) -> Attachment:
    """The attachment; redeems the pool's lease on ``session`` (None: a TCP client, no lease)
    and maps a daemon pool's memory (a CPU-mode pool needs the session: its memfd comes there).
    ``lane_timeout``: how long its fast lane waits for an answer (the client's ``timeout``)."""
    h = reply.handle
    fd = -1
    if reply.lease.ticket and session is not None:
        fd = session.redeem(reply.lease.ticket, tenant)
    try:
        tensor = None if register else map_pool(h, reply.num_slots, reply.page_size, fd)
    finally:
        if fd >= 0:
            os.close(fd)
    return Attachment(
        pool_id=reply.pool_id, tenant=tenant, page_size=reply.page_size,
        num_slots=reply.num_slots, instance=reply.instance, device=h.device, tensor=tensor,
        request=request, fast_lane=_lane(reply, lane_timeout),
        lease=reply.lease.ticket if session is not None else b"",
    )


def _lane(reply: pb.AttachReply, timeout: float) -> FastLaneClient | None:
    lane = reply.fast_lane
    if not reply.HasField("fast_lane") or not lane.path or len(lane.capability) != 16:
        return None
    return FastLaneClient(lane.path, lane.capability, timeout)


def map_pool(h: pb.PoolHandle, num_slots: int, page_size: int, fd: int = -1) -> torch.Tensor:
    """Map a daemon pool with the tier's own opener (CUDA IPC, or the memfd ``fd``)."""
    from kvtier.tiers.base import PoolHandle
    from kvtier.tiers.device import open_handle

    if h.kind == pb.HANDLE_KIND_MEMFD:
        if fd < 0:
            raise FailedPrecondition(
                "a CPU-mode pool's memory comes over the daemon's session socket: "
                "connect over its unix socket (unix://...)")
        return open_handle(PoolHandle("memfd", num_slots, page_size, h.device, fd=fd))
    if h.kind == pb.HANDLE_KIND_CUDA_IPC:
        return open_handle(PoolHandle("cuda_ipc", num_slots, page_size, h.device, ipc=h.ipc))
    raise ValueError(f"unknown pool handle kind {h.kind}")


def segment(t: torch.Tensor, memfd_ticket: bytes = b"") -> pb.Segment:
    """Describe one engine-owned ``[num_slots, slot_bytes]`` uint8 tensor for Register.

    A CPU tensor must view a sealed memfd from its byte 0 (``ipc.SharedMemory``), deposited on
    the session socket under ``memfd_ticket``."""
    if t.dim() != 2 or t.dtype != torch.uint8 or t.stride(1) != 1:
        raise ValueError("segments must be 2-D uint8 tensors with contiguous rows")
    seg = pb.Segment(num_slots=t.shape[0], slot_bytes=t.shape[1], slot_stride=t.stride(0),
                     offset=int(t.storage_offset()))
    if t.is_cuda:
        seg.ipc = ipc.encode_cuda(t.untyped_storage())
    else:
        if not memfd_ticket:
            raise ValueError("CPU segments need the sealed memfd that backs them (fds=...)")
        seg.memfd_ticket = memfd_ticket
    return seg
