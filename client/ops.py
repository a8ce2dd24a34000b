"""One description per RPC (request + how to read the reply), shared by the sync and async clients.

A capacity shortfall on Allocate/Acquire is an ordinary ``None`` return, as in the engine API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb

from .attachment import segment


@dataclass(slots=True, frozen=True)
class Op:
    method: str
    request: Any
    parse: Callable[[Any], Any] = lambda reply: reply
    none_on_shortfall: bool = False
    extra_timeout: float = 0.0  # added to the client's deadline (restores may take longer)


def attach_request(
    tenant: str, num_pages: int | None, nbytes: int | None, page_size: int, device: str,
    layout: str, default_priority: float,
) -> pb.AttachRequest:
    req = pb.AttachRequest(tenant=tenant, device=device, page_size=page_size, layout=layout,
                           default_priority=default_priority)
    if num_pages is not None:
        req.num_pages = num_pages
    if nbytes is not None:
        req.bytes = nbytes
    return req


def register_request(tenant: str, segments: Sequence[torch.Tensor], tickets: Sequence[bytes],
                     layout: str, default_priority: float) -> pb.RegisterRequest:
    """``tickets``: per segment, the session ticket of its memfd (CPU) or ``b""`` (CUDA)."""
    return pb.RegisterRequest(
        tenant=tenant, segments=[segment(t, k) for t, k in zip(segments, tickets, strict=True)],
        layout=layout, default_priority=default_priority)


def detach(ref: pb.PoolRef) -> Op:
    return Op("Detach", pb.DetachRequest(pool=ref), lambda _: None)


def allocate(ref: pb.PoolRef, n: int, priority: float | None, seq_len: int | None) -> Op:
    req = pb.AllocateRequest(pool=ref, count=n)
    if priority is not None:
        req.priority = priority
    if seq_len is not None:
        req.sequence_length = seq_len
    return Op("Allocate", req, lambda r: [(p.page_id, p.slot) for p in r.pages],
              none_on_shortfall=True)


def pages(method: str, ref: pb.PoolRef, page_ids: Sequence[int]) -> Op:
    parse = (lambda r: r.count) if method in ("Offload", "Prefetch") else (lambda _: None)
    return Op(method, pb.PagesRequest(pool=ref, page_ids=list(page_ids)), parse)


def page_tiers(ref: pb.PoolRef, page_ids: Sequence[int]) -> Op:
    def parse(r: pb.PageTiersReply) -> list[Tier | None]:
        return [None if lost else Tier(t) for t, lost in zip(r.tiers, r.lost, strict=True)]

    return Op("PageTiers", pb.PagesRequest(pool=ref, page_ids=list(page_ids)), parse)


def acquire(ref: pb.PoolRef, page_ids: Sequence[int], timeout: float | None) -> Op:
    req = pb.AcquireRequest(pool=ref, page_ids=list(page_ids), timeout_s=timeout or 0.0)
    return Op("Acquire", req, lambda r: list(r.slots), none_on_shortfall=True,
              extra_timeout=timeout or 0.0)


def set_priority(ref: pb.PoolRef, page_ids: Sequence[int], priority: float) -> Op:
    req = pb.SetPriorityRequest(pool=ref, page_ids=list(page_ids), priority=priority)
    return Op("SetPriority", req, lambda _: None)


def store(ref: pb.PoolRef, keys: Sequence[bytes], slots: Sequence[int]) -> Op:
    return Op("Store", pb.StoreRequest(pool=ref, keys=list(keys), slots=list(slots)),
              lambda r: r.count)


def lookup(tenant: str, keys: Sequence[bytes]) -> Op:
    return Op("Lookup", pb.LookupRequest(tenant=tenant, keys=list(keys)),
              lambda r: [Tier(t) for t in r.tiers])


def load(ref: pb.PoolRef, keys: Sequence[bytes], slots: Sequence[int]) -> Op:
    return Op("Load", pb.LoadRequest(pool=ref, keys=list(keys), slots=list(slots)),
              lambda r: r.count)


def load_layers(ref: pb.PoolRef, keys: Sequence[bytes], slots: Sequence[int],
                segment_bounds: Sequence[int]) -> pb.LoadLayersRequest:
    """The request of a layer-group load; its replies are a stream (one count per group)."""
    return pb.LoadLayersRequest(pool=ref, keys=list(keys), slots=list(slots),
                                segment_bounds=list(segment_bounds))


def stats(tenant: str) -> Op:
    return Op("Stats", pb.StatsRequest(tenant=tenant))
