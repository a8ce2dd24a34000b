"""Opening engine-owned KV memory named in a Register request.

CPU mode: a regular file directly under /dev/shm (never an arbitrary path: the daemon maps it
writable). CUDA mode: a kvtier IPC handle (never pickle). Each segment becomes a 2-D uint8 view
``[num_slots, slot_bytes]`` whose rows may be strided, as the engine's register() expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from kvtier.client import ipc

from kvtier.errors import InvalidArgument

from . import validate


def open_segments(segments: Sequence[Any], device: str) -> list[torch.Tensor]:
    validate.count(len(segments), "len(segments)", validate.MAX_SEGMENTS)
    views = []
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
        views.append(_open(seg, field, device))
    return views


def _open(seg: Any, field: str, device: str) -> torch.Tensor:
    need = ipc.extent(seg.num_slots, seg.slot_bytes, seg.slot_stride, seg.offset)
    if bool(seg.ipc) == bool(seg.shm_path):
        raise InvalidArgument(field, "set exactly one of ipc and shm_path")
    if seg.shm_path:
        if device != "cpu":
            raise InvalidArgument(f"{field}.shm_path", f"this daemon serves {device}: send ipc")
        try:
            flat = ipc.map_shm(seg.shm_path, need)
        except (OSError, ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"{field}.shm_path", str(exc)) from None
    else:
        if not device.startswith("cuda"):
            raise InvalidArgument(f"{field}.ipc", "this daemon runs in CPU mode: send shm_path")
        try:
            storage = ipc.decode_cuda(seg.ipc)
        except (ValueError, KeyError, RuntimeError) as exc:
            why = type(exc).__name__
            raise InvalidArgument(f"{field}.ipc", f"cannot open handle ({why})") from None
        if storage.nbytes() < need:
            raise InvalidArgument(field, f"storage holds {storage.nbytes()} bytes, needs {need}")
        flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return ipc.rows(flat, seg.num_slots, seg.slot_bytes, seg.slot_stride, seg.offset)
