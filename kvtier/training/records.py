"""What autograd holds for a saved tensor while the activation offloader is active.

    * :class:`Kept`: a tensor left on its device, with autograd's own in-place check.
    * :class:`Saved`: one offloaded byte range of a storage (``span_of``), shared by the saved
      views of that storage in one layer: the device views (until the host copy is seen done), the
      host buffer (until the last :class:`Ref` is gone) and the reloaded device bytes.
    * :class:`Ref`: one saved view of a :class:`Saved` (its dtype, shape, strides and offset); the
      record is released with its last ref.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.training.base import OffloadRaceError
from kvtier.training.streams import CopyDone

NO_OFFLOAD_ATTR = "_kvtier_no_offload"
# a non-contiguous view is offloaded with its whole storage when that is at most this many times
# its own bytes (q, k and v are each a third of their qkv storage)
MAX_SPAN_RATIO = 4


@dataclass(slots=True)
class OffloadStats:
    """Plain counters of one offloader (bytes are device bytes copied or kept)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    kept_tensors: int = 0
    kept_bytes: int = 0
    deduplicated: int = 0
    released_bytes: int = 0  # device bytes let go as soon as their copy was seen done
    reloaded_bytes: int = 0
    prefetches: int = 0
    host_waits: int = 0  # times the host waited for the compute stream to catch up
    copy_waits: int = 0  # times the host waited for copies (``max_inflight_groups``)
    device_waits: int = 0  # times the compute stream waited for copies (``drain_before_group``)


def span_of(t: torch.Tensor) -> tuple[int, int] | None:
    """Byte range of ``t``'s storage to offload, or None when ``t`` should stay."""
    es = t.element_size()
    if t.is_contiguous():
        lo = int(t.storage_offset()) * es
        return lo, lo + t.numel() * es
    nbytes = t.untyped_storage().nbytes()
    if nbytes % es or nbytes > MAX_SPAN_RATIO * t.numel() * es:
        return None
    return 0, nbytes


class Kept:
    """A saved tensor left where it is, with its version at save time (autograd's own check)."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.version = t._version

    def get(self) -> torch.Tensor:
        if self.t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.t.dtype}{list(self.t.shape)}] is at version "
                f"{self.t._version}; expected version {self.version} instead (saved while the "
                "kvtier activation offloader was active, which kept it on its device)"
            )
        return self.t


class Saved:
    """One offloaded byte range ``[lo, lo + nbytes)`` of a storage."""

    __slots__ = ("copy_done", "dev", "device", "epoch", "inflight", "keep", "lo", "nbytes", "owner",
                 "raced", "raw", "refs", "releasable", "reload_done", "versions", "views")

    def __init__(self, t: torch.Tensor, span: tuple[int, int], owner: Any, epoch: int = 0) -> None:
        self.device = t.device
        self.epoch = epoch  # the offloader's boundary count when saved
        self.lo, self.nbytes = span[0], span[1] - span[0]
        self.views: list[torch.Tensor] | None = []  # device views, held until the copy is done
        self.versions: list[int] = []
        self.raw: torch.Tensor | None = None  # host bytes
        self.dev: torch.Tensor | None = None  # reloaded device bytes
        self.copy_done: CopyDone | None = None
        self.reload_done: CopyDone | None = None
        self.refs = 0
        self.owner = owner
        self.inflight = False  # offload copy started and not yet seen done
        self.releasable = False  # the device views may go once the copy is done
        self.keep = False  # backward asked for it while the device views were held
        self.raced = False

    def changed(self) -> bool:
        assert self.views is not None
        return any(v._version != n for v, n in zip(self.views, self.versions, strict=True))


def byte_view(rec: Saved) -> torch.Tensor:
    """The device bytes of ``rec`` as a flat uint8 tensor (a view of the held storage)."""
    assert rec.views
    storage = rec.views[0].untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=rec.device).set_(
        storage, rec.lo, (rec.nbytes,), (1,))


class Ref:
    """What autograd stores instead of the tensor."""

    __slots__ = ("__weakref__", "dtype", "index", "offset", "rec", "shape", "stride", "version")

    def __init__(self, rec: Saved, t: torch.Tensor, lo: int) -> None:
        self.rec = rec
        self.dtype, self.shape, self.stride = t.dtype, t.shape, t.stride()
        self.offset = (t.storage_offset() * t.element_size() - lo) // t.element_size()
        self.version = t._version
        self.index = -1
        if rec.views is not None:
            self.index = len(rec.views)
            # detached (same storage and version counter): no cycle through its grad_fn
            rec.views.append(t.detach())
            rec.versions.append(t._version)
        rec.refs += 1

    def from_held(self) -> torch.Tensor:
        """The device tensor itself (its copy may still be running)."""
        assert self.rec.views is not None
        t = self.rec.views[self.index]
        if t._version != self.version:
            raise OffloadRaceError(
                "a saved tensor was modified in place before its offload copy was known to be done;"
                " mark_not_offload() it or clone it before the in-place op")
        return t

    def rebuild(self, data: torch.Tensor) -> torch.Tensor:
        """This view over reloaded bytes ``data``."""
        return data.view(self.dtype).as_strided(self.shape, self.stride, self.offset)

    def __del__(self) -> None:
        # at interpreter shutdown the arena may be gone already
        with suppress(Exception):
            self.rec.owner.unref(self.rec)
