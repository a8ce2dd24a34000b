"""Mapping pool memory shared between the daemon and an engine process.

Used for Register (engine-owned memory sent to the daemon): a ``/dev/shm`` file mapped shared
(CPU mode) or a CUDA IPC storage handle (GPU mode). CUDA handles travel in a small self-describing
format (``KVIPC1`` + JSON) instead of pickle, so the daemon never unpickles bytes sent by a client.
Daemon pools (Attach) are mapped with ``kvtier.tiers.device.open_handle``. Handles are
capabilities: never log them.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import torch

MAGIC = b"KVIPC1"
SHM_ROOT = "/dev/shm"
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def encode_cuda(storage: torch.UntypedStorage) -> bytes:
    """Serialize a CUDA storage's IPC handle (the storage must outlive every user)."""
    (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = (
        storage._share_cuda_()
    )
    doc: dict[str, Any] = {
        "device": int(device), "size": int(size), "offset": int(offset),
        "ref_counter_offset": int(rc_offset), "event_sync_required": bool(ev_sync),
        "handle": handle, "ref_counter_handle": rc_handle, "event_handle": ev_handle,
    }
    for k in _BYTES_FIELDS:
        doc[k] = base64.b64encode(doc[k] or b"").decode()
    return MAGIC + json.dumps(doc).encode()


def decode_cuda(blob: bytes) -> torch.UntypedStorage:
    """Open a CUDA storage from :func:`encode_cuda` bytes (never unpickles anything)."""
    if not blob.startswith(MAGIC):
        raise ValueError("not a kvtier CUDA IPC handle")
    doc = json.loads(blob[len(MAGIC):])
    raw = {k: base64.b64decode(doc[k]) for k in _BYTES_FIELDS}
    return torch.UntypedStorage._new_shared_cuda(
        doc["device"], raw["handle"], doc["size"], doc["offset"],
        raw["ref_counter_handle"], doc["ref_counter_offset"],
        raw["event_handle"] or None, doc["event_sync_required"],
    )


def map_shm(path: str, nbytes: int, *, root: str | None = SHM_ROOT) -> torch.Tensor:
    """Map ``nbytes`` of a shared-memory file as a 1-D uint8 tensor (writes are shared).

    ``root``: the file must lie directly in this directory (None: anywhere, for daemon paths).
    """
    real = os.path.realpath(path)
    if not os.path.isfile(real) or (root is not None and os.path.dirname(real) != root):
        raise ValueError(f"shm path must be a regular file directly under {root}")
    if os.path.getsize(real) < nbytes:
        raise ValueError(f"shm file holds {os.path.getsize(real)} bytes, needs {nbytes}")
    return torch.from_file(real, shared=True, size=nbytes, dtype=torch.uint8)


def rows(
    flat: torch.Tensor, num_slots: int, slot_bytes: int, stride: int, offset: int
) -> torch.Tensor:
    """A ``[num_slots, slot_bytes]`` view of ``flat`` with row ``i`` at ``offset + i * stride``."""
    return flat.as_strided((num_slots, slot_bytes), (stride, 1), offset)


def extent(num_slots: int, slot_bytes: int, stride: int, offset: int) -> int:
    """Bytes a segment spans from the start of its storage."""
    return offset + (num_slots - 1) * stride + slot_bytes
