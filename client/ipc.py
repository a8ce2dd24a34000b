"""Mapping pool memory shared between the daemon and an engine process.

Used for Register (engine-owned memory sent to the daemon): a sealed memfd mapped shared (CPU
mode: :class:`SharedMemory` makes one; its descriptor travels over the daemon's session socket,
never a path) or a CUDA IPC storage handle (GPU mode) in the one format of
``kvtier.tiers.sharing`` (``KVIPC1`` + JSON, never pickle), which daemon pools (Attach) use too.
Handles and descriptors are capabilities: never log them.
"""

from __future__ import annotations

import os

from kvtier.tiers import memfd
from kvtier.tiers.sharing import MAGIC, decode_cuda, encode_cuda, extent, rows

__all__ = ["MAGIC", "SharedMemory", "decode_cuda", "encode_cuda", "extent", "rows"]


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
