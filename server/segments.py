"""Opening engine-owned KV memory named in a Register request.

CPU mode: a sealed memfd the client deposited on its session socket (``server/fdpass.py``),
named by its ticket; never a path, so a tenant can only register memory it holds. The memfd must
be sealed against shrinking and growing (else a client could truncate it under the daemon's
mapping: SIGBUS), checked with ``F_GET_SEALS`` and ``fstat``. CUDA mode: a kvtier IPC handle
(never pickle). Each segment becomes a 2-D uint8 view ``[num_slots, slot_bytes]`` whose rows may
be strided, as the engine's register() expects. ``open_segments`` returns the views and the
session that deposited the memory (it holds the pool's lease), or ``None`` in CUDA mode.
A failed Register has used up its tickets: the client deposits again.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.errors import FailedPrecondition, InvalidArgument
from kvtier.tiers import memfd, sharing

from . import validate
from .tickets import Tickets


def open_segments(segments: Sequence[Any], device: str, tenant: str,
                  tickets: Tickets | None) -> tuple[list[torch.Tensor], int | None]:
    validate.count(len(segments), "len(segments)", validate.MAX_SEGMENTS)
    slots = segments[0].num_slots
    for i, seg in enumerate(segments):
        field = f"segments[{i}]"
        validate.count(seg.num_slots, f"{field}.num_slots", validate.MAX_POOL_SLOTS)
        if seg.num_slots != slots:
            raise InvalidArgument(f"{field}.num_slots", "every segment needs the same num_slots")
        validate.count(seg.slot_bytes, f"{field}.slot_bytes", 1 << 30)
        if seg.slot_stride < seg.slot_bytes:
            raise InvalidArgument(f"{field}.slot_stride", "must be >= slot_bytes")
        validate.non_negative(seg.offset, f"{field}.offset")
        _check_kind(seg, field, device)
    if device.startswith("cuda"):
        return [_open_cuda(seg, f"segments[{i}]") for i, seg in enumerate(segments)], None
    if tickets is None:
        raise FailedPrecondition("segments: CPU memory needs the daemon's session socket")
    return _open_memfds(segments, tenant, tickets)


def _check_kind(seg: Any, field: str, device: str) -> None:
    if bool(seg.ipc) == bool(seg.memfd_ticket):
        raise InvalidArgument(field, "set exactly one of ipc and memfd_ticket")
    if seg.memfd_ticket and device != "cpu":
        raise InvalidArgument(f"{field}.memfd_ticket", f"this daemon serves {device}: send ipc")
    if seg.ipc and not device.startswith("cuda"):
        raise InvalidArgument(f"{field}.ipc", "this daemon runs in CPU mode: send memfd_ticket")


def _open_memfds(segments: Sequence[Any], tenant: str, tickets: Tickets
                 ) -> tuple[list[torch.Tensor], int | None]:
    """Each distinct ticket is taken, checked and mapped once (as far as its segments reach:
    one memory mapping per memfd, however many segments view it); every descriptor taken is
    closed before returning, and nothing stays mapped on an error."""
    taken: dict[bytes, tuple[int, int]] = {}
    reach: dict[bytes, tuple[int, str]] = {}  # ticket -> bytes its segments need, first field
    flats: dict[bytes, torch.Tensor] = {}
    try:
        for i, seg in enumerate(segments):
            field = f"segments[{i}].memfd_ticket"
            if seg.memfd_ticket not in taken:
                got = tickets.take_deposit(seg.memfd_ticket, tenant)
                if got is None:
                    raise FailedPrecondition(
                        f"{field}: unknown, used, expired or another tenant's ticket")
                taken[seg.memfd_ticket] = got
            need = sharing.extent(seg.num_slots, seg.slot_bytes, seg.slot_stride, seg.offset)
            memfd.check(taken[seg.memfd_ticket][0], need, field)
            most, _ = reach.get(seg.memfd_ticket, (0, field))
            reach[seg.memfd_ticket] = (max(most, need), field)
        for ticket, (need, field) in reach.items():
            try:
                flats[ticket] = memfd.map_shared(taken[ticket][0], need)
            except (OSError, ValueError, RuntimeError) as exc:
                raise FailedPrecondition(f"{field}: cannot map ({exc})") from None
        views = [sharing.rows(flats[seg.memfd_ticket], seg.num_slots, seg.slot_bytes,
                              seg.slot_stride, seg.offset) for seg in segments]
        return views, next(iter(taken.values()))[1]
    finally:
        flats.clear()  # the views hold what they need; an error's frames hold no mapping
        for fd, _ in taken.values():
            os.close(fd)


def _open_cuda(seg: Any, field: str) -> torch.Tensor:
    return sharing.open_rows(seg.ipc, seg.num_slots, seg.slot_bytes, seg.slot_stride,
                             seg.offset, field)
