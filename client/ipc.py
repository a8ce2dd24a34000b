"""Mapping pool memory shared between the daemon and an engine process.

Used for Register (engine-owned memory sent to the daemon): a sealed memfd mapped shared (CPU
mode: :class:`SharedMemory` makes one; its descriptor travels over the daemon's session socket,
never a path) or a CUDA IPC storage handle (GPU mode). CUDA handles travel in a small
self-describing format (``KVIPC1`` + JSON) instead of pickle, so the daemon never unpickles bytes
sent by a client. Daemon pools (Attach) are mapped with ``kvtier.tiers.device.open_handle``.
Handles and descriptors are capabilities: never log them.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import torch

from kvtier.tiers import memfd

MAGIC = b"KVIPC1"
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


class SharedMemory:
    """CPU memory an engine owns and may Register: a sealed memfd, mapped here.

    ``tensor`` is 1-D ``uint8`` of ``nbytes`` (shared with the daemon once registered); view
    segments into it and pass ``fd`` once per segment: ``register(segs, fds=[mem.fd] * n)``.
    The memfd can't be shrunk or grown by anyone, so the daemon can't be hurt through it.
    ``close()`` closes the descriptor; the mapping lives while tensors use it.
    """

    def __init__(self, nbytes: int, name: str = "kvtier-engine") -> None:
        self.nbytes = nbytes
        self.fd = memfd.create(nbytes, name)
        try:
            self.tensor = memfd.map_shared(self.fd, nbytes)
        except (OSError, ValueError, RuntimeError):
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SharedMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rows(
    flat: torch.Tensor, num_slots: int, slot_bytes: int, stride: int, offset: int
) -> torch.Tensor:
    """A ``[num_slots, slot_bytes]`` view of ``flat`` with row ``i`` at ``offset + i * stride``."""
    return flat.as_strided((num_slots, slot_bytes), (stride, 1), offset)


def extent(num_slots: int, slot_bytes: int, stride: int, offset: int) -> int:
    """Bytes a segment spans from the start of its storage."""
    return offset + (num_slots - 1) * stride + slot_bytes
