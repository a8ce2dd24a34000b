"""How pool memory is shared between processes: one CUDA IPC handle format, and row views.

Both directions use it: the daemon's own pools (Attach: the daemon encodes, the engine opens)
and engine-owned memory (Register: the engine encodes, the daemon opens). CPU-mode memory is a
sealed memfd instead (``kvtier.tiers.memfd``); its descriptor travels over the session socket.

    * ``encode_cuda(storage) -> bytes``: ``KVIPC1`` + JSON of the storage's CUDA IPC handle
      (device, size, offset, torch's cross-process ref counter, the event). Self-describing and
      never pickled, so neither side ever unpickles bytes from the other. The bytes are a
      capability: never log them.
    * ``decode_cuda(blob) -> storage``: opens it (same user, same GPU; torch keeps one mapping
      per handle per process), initialising CUDA in this process first if nothing has yet (an
      engine may attach before it touches the GPU). Any malformed blob, or a process without
      CUDA, raises ``InvalidArgument`` naming ``field``.
    * ``rows(flat, num_slots, slot_bytes, stride, offset)``: the ``[num_slots, slot_bytes]`` view
      of a flat ``uint8`` tensor with row ``i`` at ``offset + i * stride``; ``extent`` is the
      bytes such a view spans; ``open_rows`` decodes a blob and checks the storage holds them.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import torch

from kvtier.errors import InvalidArgument

MAGIC = b"KVIPC1"
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")
_INT_FIELDS = ("device", "size", "offset", "ref_counter_offset")


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


def decode_cuda(blob: bytes, field: str = "ipc") -> torch.UntypedStorage:
    """Open a CUDA storage from :func:`encode_cuda` bytes (never unpickles anything)."""
    if not blob.startswith(MAGIC):
        raise InvalidArgument(field, "not a kvtier CUDA IPC handle")
    try:
        doc = json.loads(blob[len(MAGIC):])
        raw = {k: base64.b64decode(doc[k], validate=True) for k in _BYTES_FIELDS}
        ints = {k: doc[k] for k in _INT_FIELDS}
        if not all(type(v) is int and v >= 0 for v in ints.values()):
            raise ValueError("negative or non-integer field")
        sync = bool(doc["event_sync_required"])
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise InvalidArgument(field, f"cannot open handle ({type(exc).__name__})") from None
    if not torch.cuda.is_available():
        raise InvalidArgument(field, "a CUDA IPC handle, and this process has no CUDA device")
    torch.cuda.init()  # opening a handle needs CUDA's state (a process may not have used it)
    try:
        return torch.UntypedStorage._new_shared_cuda(
            ints["device"], raw["handle"], ints["size"], ints["offset"],
            raw["ref_counter_handle"], ints["ref_counter_offset"], raw["event_handle"] or None,
            sync,
        )
    except (ValueError, RuntimeError) as exc:
        raise InvalidArgument(field, f"cannot open handle ({type(exc).__name__})") from None


def rows(
    flat: torch.Tensor, num_slots: int, slot_bytes: int, stride: int, offset: int
) -> torch.Tensor:
    """A ``[num_slots, slot_bytes]`` view of ``flat`` with row ``i`` at ``offset + i * stride``."""
    return flat.as_strided((num_slots, slot_bytes), (stride, 1), offset)


def extent(num_slots: int, slot_bytes: int, stride: int, offset: int) -> int:
    """Bytes a segment spans from the start of its storage."""
    return offset + (num_slots - 1) * stride + slot_bytes


def open_rows(blob: bytes, num_slots: int, slot_bytes: int, stride: int, offset: int,
              field: str) -> torch.Tensor:
    """Decode ``blob`` and view its storage as rows; a storage too small is refused."""
    storage = decode_cuda(blob, f"{field}.ipc")
    need = extent(num_slots, slot_bytes, stride, offset)
    if storage.nbytes() < need:
        raise InvalidArgument(field, f"storage holds {storage.nbytes()} bytes, needs {need}")
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return rows(flat, num_slots, slot_bytes, stride, offset)
