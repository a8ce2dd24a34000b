"""Copy-engine calls by address: ``cudaMemcpyAsync`` and ``cudaMemcpy2DAsync`` of the CUDA
runtime torch has loaded, called without releasing the interpreter lock.

Why not ``Tensor.copy_``: a host<->device ``copy_`` costs ~25 us of host time per call (and
each call may hand the interpreter lock to another thread and wait a switch interval to get it
back); the handlers issue one per contiguous host run and the layered restore one per block and
layer group. And torch has no strided host->device copy that stays a DMA (a non-contiguous host
source is first gathered on the host). These calls take ~1-2 us and never give up the lock:
they only queue work on a stream.

Contract:
    * ``runtime()`` -> ``Runtime`` or None (no CUDA, or no CUDA runtime library found in the
      process): callers then use ``Tensor.copy_``. Looked up once.
    * ``Runtime.copy(dst, src, nbytes, stream)``: ``cudaMemcpyAsync(.., cudaMemcpyDefault, ..)``
      between any two addresses the device can reach (device memory, pinned host memory).
    * ``Runtime.copy_2d(dst, dst_pitch, src, src_pitch, width, height, stream)``: ``height``
      rows of ``width`` bytes, each row at its pitch.
    * ``stream`` is a ``torch.cuda.Stream`` (its handle is used); both raise ``RuntimeError``
      naming the CUDA error. Asynchronous: the caller orders and waits as for any stream work,
      and keeps source and destination alive until then.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_DEFAULT = 4  # cudaMemcpyDefault: the direction from the addresses (unified addressing)
_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class Runtime:
    """See the module docstring."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        size, ptr, c_int = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [ptr, ptr, size, c_int, ptr]
        lib.cudaMemcpyAsync.restype = c_int
        lib.cudaMemcpy2DAsync.argtypes = [ptr, size, ptr, size, size, size, c_int, ptr]
        lib.cudaMemcpy2DAsync.restype = c_int
        lib.cudaGetErrorString.argtypes = [c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = c_int
        self._copy = lib.cudaMemcpyAsync
        self._copy_2d = lib.cudaMemcpy2DAsync

    def copy(self, dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        self._check(self._copy(dst, src, nbytes, _DEFAULT, stream.cuda_stream), "cudaMemcpyAsync")

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                height: int, stream: torch.cuda.Stream) -> None:
        rc = self._copy_2d(dst, dst_pitch, src, src_pitch, width, height, _DEFAULT,
                           stream.cuda_stream)
        self._check(rc, "cudaMemcpy2DAsync")

    def _check(self, rc: int, what: str) -> None:
        if rc:
            # The runtime also keeps the error as the thread's last error: clear it, or the
            # next kernel launch torch checks would report it as its own.
            self._lib.cudaGetLastError()
            msg = self._lib.cudaGetErrorString(rc)
            raise RuntimeError(f"{what}: CUDA error {rc} ({msg.decode() if msg else '?'})")


def _loaded_path() -> str | None:
    """The CUDA runtime library this process mapped (torch's), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.cache
def runtime() -> Runtime | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # torch maps its CUDA runtime library now
    for name in (_loaded_path(), *_NAMES):
        if not name:
            continue
        try:
            # PyDLL: calls keep the interpreter lock (they only queue work: microseconds).
            return Runtime(ctypes.PyDLL(name))
        except (OSError, AttributeError):
            continue
    log.info("no CUDA runtime library found by name; copies go through Tensor.copy_")
    return None
